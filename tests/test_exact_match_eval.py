"""`trainer.evaluate exact_match`: greedy answers to held-out prompts, each check function's mean with a 95%
interval, the mean response length, JSON + Markdown with provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.cli import UsageError
from trainer.evaluate import check_summary, main
from trainer.run_report import wilson_interval

CHECKS = '''
def even_answer(completions, answer, **_):
    return [float(int(a) % 2 == 0) for a in answer]

def tokens(completions, completion_ids, **_):
    return [float(len(ids)) for ids in completion_ids]

def only_small(completions, answer, **_):
    return [float(int(a) < 3) if int(a) < 5 else None for a in answer]
'''


def held_out(path: Path, answers: list[int]) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 0? End with 'Answer: N'."}], "answer": str(a)}
            for a in answers]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_check_summary_uses_wilson_for_zero_one_scores_and_leaves_out_none():
    summary = check_summary([1.0, 0.0, None, 1.0, 1.0])
    assert summary["mean"] == 0.75 and summary["rows"] == 4 and summary["interval"] == "wilson"
    assert summary["ci95"] == pytest.approx(list(wilson_interval(0.75, 4)))
    spread = check_summary([2.0, 4.0, 6.0, 8.0])  # not 0/1: mean +- 1.96 standard errors
    assert spread["interval"] == "normal" and spread["mean"] == 5.0
    assert spread["ci95"] == pytest.approx([5.0 - 1.96 * 2.5819889 / 2, 5.0 + 1.96 * 2.5819889 / 2])
    assert check_summary([None, None]) == {"mean": None, "ci95": None, "interval": None, "rows": 0}


def test_exact_match_reports_each_check_with_its_interval_and_writes_json_and_markdown(tmp_path):
    (tmp_path / "checks.py").write_text(CHECKS)
    data = held_out(tmp_path / "heldout.jsonl", [1, 2, 3, 4, 6, 8, 9])
    checks = ",".join(f"{tmp_path / 'checks.py'}:{n}" for n in ("even_answer", "tokens", "only_small"))
    out = tmp_path / "eval" / "before.json"
    result = main(["exact_match", "--adapter", "none", "--model_name_or_path", "tiny-llama", "--data", str(data),
                   "--reward_fn", checks, "--max_new_tokens", "3", "--batch_size", "3", "--samples", "2",
                   "--output_file", str(out), "--progress_bar", "false"])
    assert result["rows"] == 7 and result["decoding"] == "greedy" and result["skipped_rows"] == 0
    even = result["checks"]["even_answer"]
    assert even["mean"] == pytest.approx(4 / 7) and even["rows"] == 7 and even["interval"] == "wilson"
    assert even["ci95"] == pytest.approx(list(wilson_interval(4 / 7, 7)))
    small = result["checks"]["only_small"]  # None (answers 5 and up) left out: 1 and 2 right of 1, 2, 3, 4
    assert small["rows"] == 4 and small["mean"] == 0.5
    # the mean length counts the response tokens the functions were given
    assert result["checks"]["tokens"]["mean"] == pytest.approx(result["mean_length"]["mean"])
    assert 1 <= result["mean_length"]["mean"] <= 3
    assert [s["answer"] for s in result["samples"]] == ["1", "2"] and all("response" in s for s in result["samples"])
    saved = json.loads(out.read_text())
    assert saved["checks"] == result["checks"] and saved["provenance"]["git_revision"]
    assert "exact_match" in saved["provenance"]["command"]
    page = out.with_suffix(".md").read_text()
    low, high = even["ci95"]
    assert f"| even_answer | {4 / 7:.3f} | {low:.3f} - {high:.3f} (wilson) | 7 |" in page
    assert "Command: `" in page and "git revision" in page


def test_exact_match_needs_check_functions_and_data(tmp_path):
    data = held_out(tmp_path / "heldout.jsonl", [1])
    with pytest.raises(UsageError, match="--reward_fn"):
        main(["exact_match", "--adapter", "none", "--model_name_or_path", "tiny-llama", "--data", str(data)])
    with pytest.raises(UsageError, match="--data"):
        main(["exact_match", "--adapter", "none", "--model_name_or_path", "tiny-llama",
              "--reward_fn", "benchmarks/arithmetic/rewards.py:correct"])


def test_exact_match_evaluates_a_trained_adapter_on_the_base_it_was_trained_on(tmp_path):
    import trainer.grpo as grpo

    (tmp_path / "checks.py").write_text(CHECKS)
    data = held_out(tmp_path / "heldout.jsonl", list(range(1, 41)))
    tiny_grpo = Path(__file__).parent / "configs" / "tiny_grpo.yaml"
    grpo.main(["--config", str(tiny_grpo), "--output_dir", str(tmp_path / "run"), "--dataset", str(data),
               "--ppo_size", "32", "--eval_prompts", "0", "--scripted_reward", "null",
               "--reward_fn", f"{tmp_path / 'checks.py'}:tokens"])
    result = main(["exact_match", "--adapter", str(tmp_path / "run" / "adapter"), "--data", str(data), "--limit", "5",
                   "--reward_fn", f"{tmp_path / 'checks.py'}:even_answer", "--max_new_tokens", "2",
                   "--progress_bar", "false"])
    assert result["base_model"] == "tiny-llama"  # from the adapter's folder, not the default base
    assert result["rows"] == 5 and result["checks"]["even_answer"]["mean"] == pytest.approx(2 / 5)


def test_an_output_file_on_a_read_only_filesystem_is_refused_before_the_evaluation(tmp_path, monkeypatch):
    import errno

    import foundation.files
    import trainer.evaluate

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(foundation.files.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(trainer.evaluate, "evaluate", lambda *a, **k: pytest.fail("the evaluation ran"))
    data = held_out(tmp_path / "heldout.jsonl", [1])
    out = tmp_path / "results" / "eval.json"
    with pytest.raises(UsageError, match=rf"--output_file {out}: cannot write in {tmp_path} \(Read-only file system\)"):
        main(["exact_match", "--adapter", "none", "--model_name_or_path", "tiny-llama", "--data", str(data),
              "--reward_fn", "benchmarks/arithmetic/rewards.py:correct", "--output_file", str(out)])


def test_the_wilson_interval_stays_in_zero_to_one_at_either_end():
    for n in (1, 7, 300, 10_000):
        low, high = wilson_interval(0.0, n)
        assert low == 0.0 and 0 < high < 1
        low, high = wilson_interval(1.0, n)
        assert 0 < low < 1 and high == 1.0


def test_answers_longer_than_the_model_s_positions_are_refused_before_decoding(tmp_path, monkeypatch):
    """The tiny preset has 1024 positions: prompt + --max_new_tokens past them is one line (training refuses it
    too), not a generation past the model's positions."""
    import trainer.evaluate

    monkeypatch.setattr(trainer.evaluate, "build_shared_model", lambda *a, **k: pytest.fail("the model was built"))
    data = held_out(tmp_path / "heldout.jsonl", [1, 2])
    with pytest.raises(UsageError, match=r"--max_new_tokens 5000: the longest prompt \(\d+ tokens\) and its answer "
                                         r"exceed the 1024 positions of tiny-llama: use at most \d+"):
        main(["exact_match", "--adapter", "none", "--model_name_or_path", "tiny-llama", "--data", str(data),
              "--reward_fn", "benchmarks/arithmetic/rewards.py:correct", "--max_new_tokens", "5000"])
