"""The arithmetic task (benchmarks/arithmetic/): problems with one exact answer and the functions that check it."""

from __future__ import annotations

import json

from benchmarks.arithmetic.make_data import INSTRUCTION, main
from benchmarks.arithmetic.rewards import correct, formatted, parse_answer


def question(row: dict) -> str:
    """The problem of a row, after the worked example every prompt shows first."""
    content = row["prompt"][0]["content"]
    assert content.startswith(INSTRUCTION) and "Answer: N" in INSTRUCTION
    return content.rsplit("Problem: ", 1)[1]


def test_the_task_writes_disjoint_train_and_held_out_problems_with_their_answers(tmp_path):
    assert main(["--out", str(tmp_path / "t"), "--train", "300", "--heldout", "100", "--seed", "3"]) == {
        "train": 300, "heldout": 100}
    train, heldout = ([json.loads(line) for line in (tmp_path / "t" / f"{n}.jsonl").read_text().splitlines()]
                      for n in ("train", "heldout"))
    questions = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(questions(train)) == 300 and len(questions(heldout)) == 100 and not questions(train) & questions(heldout)
    for row in train + heldout:  # every answer is the problem's own arithmetic
        text = question(row)
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


def test_the_one_digit_level_adds_or_takes_away_numbers_under_ten(tmp_path):
    main(["--out", str(tmp_path / "t"), "--train", "200", "--heldout", "50", "--level", "one_digit"])
    for line in (tmp_path / "t" / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        numbers = [int(w) for w in question(row).replace(".", " ").split() if w.isdigit()]
        a, b = numbers
        assert int(row["answer"]) in {a + b, a - b} and b < 10 and (a < 10 or int(row["answer"]) < 10)


def test_the_result_says_whether_a_figure_moved_beyond_its_interval():
    from benchmarks.arithmetic.report import moved, verdict

    start = {"mean": 0.10, "ci95": [0.07, 0.14]}
    assert moved(start, {"mean": 0.30, "ci95": [0.25, 0.35]}) == "apart"
    assert moved(start, {"mean": 0.16, "ci95": [0.12, 0.20]}) == "outside"
    assert moved(start, {"mean": 0.12, "ci95": [0.09, 0.16]}) == "within"
    assert "did not move beyond noise" in verdict("Exact match", start, {"mean": 0.12, "ci95": [0.09, 0.16]})
    assert verdict("Exact match", start, {"mean": 0.30, "ci95": [0.25, 0.35]}) == (
        "Exact match went from 0.100 to 0.300: the 95% intervals do not overlap, so it moved beyond its interval.")


def test_the_result_counts_the_answers_a_policy_gives_and_names_a_collapse():
    from benchmarks.arithmetic.report import answer_counts, collapse, described_counts

    responses = ["Answer: 10", "Answer: 10", "x\nAnswer: 7", "no idea"]
    counts = answer_counts({"rows": 4, "samples": [{"response": r} for r in responses]})
    assert described_counts(counts) == "3 distinct; most often 10 50%, 7 25%, no answer line 25%"
    assert collapse(counts).startswith("The trained policy answers 10 to 50% of the problems")
    assert collapse(counts, share=0.6) is None
    assert answer_counts({"rows": 5, "samples": [{"response": r} for r in responses]}) is None  # not all kept
