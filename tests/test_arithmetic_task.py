"""The arithmetic task (benchmarks/arithmetic/): problems with one exact answer and the functions that check it."""

from __future__ import annotations

import json

from benchmarks.arithmetic.make_data import main
from benchmarks.arithmetic.rewards import correct, formatted, parse_answer


def test_the_task_writes_disjoint_train_and_held_out_problems_with_their_answers(tmp_path):
    assert main(["--out", str(tmp_path / "t"), "--train", "300", "--heldout", "100", "--seed", "3"]) == {
        "train": 300, "heldout": 100}
    train, heldout = ([json.loads(line) for line in (tmp_path / "t" / f"{n}.jsonl").read_text().splitlines()]
                      for n in ("train", "heldout"))
    questions = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(questions(train)) == 300 and len(questions(heldout)) == 100 and not questions(train) & questions(heldout)
    for row in train + heldout:  # every answer is the problem's own arithmetic
        text = row["prompt"][0]["content"].split("\n")[0]
        numbers = [int(w.strip(".,")) for w in text.split() if w.strip(".,").isdigit()]
        assert int(row["answer"]) in {numbers[0] + numbers[1], numbers[0] - numbers[1], numbers[0] * numbers[1]} | (
            {numbers[0] + numbers[1] - numbers[2]} if len(numbers) == 3 else set())
    main(["--out", str(tmp_path / "u"), "--train", "10", "--heldout", "100", "--seed", "3"])
    assert (tmp_path / "u" / "heldout.jsonl").read_text() == (tmp_path / "t" / "heldout.jsonl").read_text()


def test_the_reward_functions_read_only_a_last_answer_line():
    completions = ["22 + 45 = 67\nAnswer: 67", "Answer: 66", "so 67", "Answer: 67 apples", [{"role": "assistant",
                                                                                           "content": "Answer: -3"}]]
    assert [parse_answer(c) for c in completions] == ["67", "66", None, None, "-3"]
    assert correct(completions, answer=["67", "67", "67", "67", "-3"]) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert formatted(completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
