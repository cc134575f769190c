"""The run report's tables: pairwise accuracies carry a confidence interval, so noise reads as noise."""

from __future__ import annotations

import math

import pytest

from trainer.run_report import bootstrap_perplexity_interval, stage_table, wilson_interval


def test_wilson_interval_matches_the_textbook_values():
    low, high = wilson_interval(0.5, 100)
    assert (round(low, 4), round(high, 4)) == (0.4038, 0.5962)
    low, high = wilson_interval(1.0, 10)  # the normal approximation would give 1.0-1.0 here
    assert round(low, 4) == 0.7225 and high == pytest.approx(1.0)


def test_perplexity_bootstrap_interval_over_rows():
    # every row alike: each resample has the same mean NLL, so the interval is the point exp(1.5)
    low, high = bootstrap_perplexity_interval([3.0, 6.0, 1.5], [2, 4, 1])
    assert low == pytest.approx(math.exp(1.5)) and high == pytest.approx(math.exp(1.5))
    # two kinds of rows: the interval holds the pooled perplexity, lies within the extremes, narrows with more rows
    nll, tokens = [1.0, 3.0] * 20, [1, 1] * 20
    low, high = bootstrap_perplexity_interval(nll, tokens)
    assert math.exp(1.0) < low < math.exp(2.0) < high < math.exp(3.0)
    low4, high4 = bootstrap_perplexity_interval(nll * 4, tokens * 4)
    assert low < low4 < math.exp(2.0) < high4 < high
    assert bootstrap_perplexity_interval(nll, tokens) == (low, high)  # a fixed seed: the same rows, the same interval
    with pytest.raises(ValueError, match="one token count per row"):
        bootstrap_perplexity_interval([1.0], [1, 2])


def test_accuracy_rows_show_the_interval_and_the_pair_count():
    results = {
        "sft": {"eval_before": {"eval/perplexity": 12.0, "eval/tokens": 900.0},
                "eval_after": {"eval/perplexity": 10.0, "eval/tokens": 900.0}},
        "reward": {"eval_before": {"eval/accuracy": 0.5, "eval/pairs": 100.0},
                   "eval_after": {"eval/accuracy": 0.64, "eval/pairs": 100.0}, "seconds": 12.0},
    }
    lines = stage_table(results)
    sft_row = next(line for line in lines if line.startswith("| sft "))
    reward_row = next(line for line in lines if line.startswith("| reward "))
    assert "CI" not in sft_row and "| - |" in sft_row  # not timed outside the pipeline
    assert "accuracy 0.5 (95% CI 0.40-0.60, 100 pairs)" in reward_row
    assert "accuracy 0.64 (95% CI 0.54-0.73, 100 pairs)" in reward_row and "| 12 |" in reward_row


def test_saved_evaluations_appear_with_their_interval(tmp_path):
    import json

    from trainer.run_report import evaluation_table

    (tmp_path / "dpo").mkdir()
    (tmp_path / "dpo" / "evaluation-eval.json").write_text(json.dumps(
        {"task": "dpo", "split": "eval", "rewards/accuracies": 0.5, "pairs": 100.0,
         "accuracy_ci95": list(wilson_interval(0.5, 100))}))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "evaluation-all.json").write_text(json.dumps({"task": "sft", "perplexity": 9.5}))
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "evaluation-heldout.json").write_text(json.dumps(
        {"task": "exact_match", "checks": {"correct": {"mean": 0.25, "ci95": [0.2, 0.3], "interval": "wilson",
                                                       "rows": 300}}}))
    lines = evaluation_table(tmp_path)
    assert ("| exact_match | all | correct 0.250 (95% CI 0.200-0.300, 300 rows) | `grpo/evaluation-heldout.json` |"
            in lines)
    assert "| dpo | eval | accuracy 0.5 (95% CI 0.404-0.596, 100 pairs) | `dpo/evaluation-eval.json` |" in lines
    assert "| sft | all | perplexity 9.5 | `sft/evaluation-all.json` |" in lines
    assert evaluation_table(tmp_path / "dpo") == []


def test_stage_rows_show_the_mean_step_time_and_peak_memory_from_the_metrics(tmp_path):
    import json

    (tmp_path / "grpo").mkdir()
    rows = [{"step": 1, "perf/step_s": 2.0, "perf/peak_rss_gb": 1.5}, {"step": 1, "eval/score_policy": 0.3},
            {"step": 2, "perf/step_s": 4.0, "perf/peak_rss_gb": 1.75}]
    (tmp_path / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {"grpo": {"eval_before": {"eval/score_policy": 0.1}, "eval_after": {"eval/score_policy": 0.3}},
               "sft": {}}
    lines = stage_table(results, tmp_path)
    assert "| grpo | - | 3 | 1.75 (process RSS) | score_policy 0.1 | score_policy 0.3 |" in lines
    assert next(line for line in lines if line.startswith("| sft ")).startswith("| sft | - | - | - |")  # no metrics


def rl_evaluations(kl, score, length_policy=20.0, length_sft=20.0):
    """metrics.jsonl rows of an RL stage: a training row, then one evaluation per (kl, score)."""
    rows = [{"step": 1, "reward": 0.1}]
    for i, (k, s) in enumerate(zip(kl, score)):
        rows.append({"step": 10 * i, "eval/score_policy": s, "eval/score_sft": 0.2, "eval/kl": k,
                     "eval/response_length_policy": length_policy if i == len(kl) - 1 else length_sft,
                     "eval/response_length_sft": length_sft})
    return rows


def test_reward_hacking_warns_when_the_mean_length_moves_more_than_half():
    from trainer.run_report import reward_hacking_signs

    short = reward_hacking_signs("grpo", rl_evaluations([0.0, 0.5], [0.2, 0.9], length_policy=9.0))
    assert short == ["grpo's mean response length went from 20.0 to 9.0 tokens (-55%) by step 10"]
    long = reward_hacking_signs("ppo", rl_evaluations([0.0, 0.5], [0.2, 0.9], length_policy=31.0))
    assert long == ["ppo's mean response length went from 20.0 to 31.0 tokens (+55%) by step 10"]
    for within in (11.0, 10.0, 29.0, 30.0):  # half away or less: no warning
        assert reward_hacking_signs("grpo", rl_evaluations([0.0, 0.5], [0.2, 0.9], length_policy=within)) == []


def test_reward_hacking_warns_when_kl_rises_over_the_last_three_evaluations_while_the_score_falls():
    from trainer.run_report import reward_hacking_signs

    rising_kl = [0.0, 0.1, 0.3, 0.6]
    assert reward_hacking_signs("grpo", rl_evaluations(rising_kl, [0.2, 0.5, 0.4, 0.3])) == [
        "grpo's KL to the reference rose over its last three evaluations (0.1 -> 0.3 -> 0.6) while the held-out "
        "score fell (0.5 -> 0.4 -> 0.3)"]
    assert reward_hacking_signs("grpo", rl_evaluations(rising_kl, [0.2, 0.3, 0.4, 0.5])) == []  # score rises
    assert reward_hacking_signs("grpo", rl_evaluations(rising_kl, [0.2, 0.5, 0.6, 0.5])) == []  # back where it was
    assert reward_hacking_signs("grpo", rl_evaluations([0.0, 0.3, 0.2, 0.6], [0.2, 0.5, 0.4, 0.3])) == []  # KL dips
    assert reward_hacking_signs("grpo", rl_evaluations([0.1, 0.6], [0.5, 0.3])) == []  # fewer than three evaluations
    assert reward_hacking_signs("sft", [{"step": 1, "eval/loss": 2.0}]) == []  # not an RL stage


def test_the_report_says_reward_hacking_in_one_line_at_the_top(tmp_path):
    import json

    from trainer.run_report import write_run_report

    def report(rows):
        (tmp_path / "grpo").mkdir(exist_ok=True)
        (tmp_path / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return write_run_report(tmp_path, results={"grpo": {}}).read_text().splitlines()

    lines = report(rl_evaluations([0.0, 0.1, 0.3, 0.6], [0.2, 0.5, 0.4, 0.3], length_policy=6.0))
    warnings = [line for line in lines if "reward hacking" in line]
    assert len(warnings) == 1 and lines.index(warnings[0]) < lines.index("## Stages")
    assert "length went from 20.0 to 6.0" in warnings[0] and "KL to the reference rose" in warnings[0]
    assert not any("reward hacking" in line for line in report(rl_evaluations([0.0, 0.1, 0.2], [0.2, 0.3, 0.4])))


def test_the_time_of_an_rl_step_splits_into_rollout_and_update_with_the_first_step_apart(tmp_path):
    import json

    from trainer.run_report import rl_time_table, write_run_report

    def metrics(stage, rows):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def step(n, rollout, update, tokens, fraction=None):
        row = {"step": n, "perf/step_s": rollout + update, "perf/rollout_s": rollout, "perf/update_s": update,
               "perf/decode_tokens_per_s": tokens}
        return row if fraction is None else {**row, "perf/decode_bandwidth_fraction": fraction}

    # the first step compiles; the later ones' medians: step 5 of (4, 5, 8), rollout 3 (60%), update 2 (40%)
    metrics("grpo", [step(1, 40.0, 2.0, 10.0, 0.01), {"step": 1, "eval/score_policy": 0.3},
                     step(2, 3.0, 1.0, 600.0, 0.25), step(3, 3.0, 2.0, 500.0, 0.2), step(4, 5.0, 3.0, 400.0, 0.1)])
    metrics("ppo", [step(1, 6.0, 10.0, 47.0), step(2, 5.0, 11.0, 46.0)])  # on a CPU: no bandwidth bound
    metrics("sft", [{"step": 1, "perf/step_s": 2.0}])  # not an RL stage: no row
    lines = rl_time_table(tmp_path, ["sft", "grpo", "ppo"])
    assert "| grpo | 4 | 42 | 5 | 3 (60%) | 2 (40%) | 500 | 20.0% |" in lines
    assert "| ppo | 2 | 16 | 16 | 5 (31%) | 11 (69%) | 46 | - |" in lines  # one later step: its own figures
    assert not any(line.startswith("| sft ") for line in lines)
    assert rl_time_table(tmp_path, ["sft"]) == []
    report = write_run_report(tmp_path, results={"sft": {}, "grpo": {}, "ppo": {}}).read_text()
    assert "## Time per RL step" in report and "| grpo | 4 | 42 | 5 | 3 (60%) |" in report


def write_metrics(folder, lines: list) -> None:
    """metrics.jsonl from rows (dicts) and raw lines (str), as a run or a hand edit would leave them."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))


def test_metrics_values_that_are_not_numbers_show_as_missing_and_are_named_once(tmp_path, caplog):
    from trainer.run_report import write_run_report

    write_metrics(tmp_path / "grpo", [
        {"step": 1, "perf/step_s": "fast", "perf/rollout_s": 1.0, "perf/update_s": 1.0, "perf/peak_rss_gb": 1.5,
         "rewards/f/mean": "high", "rewards/f/std": 0.1, "objective/scores": "x"},
        '{"step": 2, "perf/step_s": 4.0, "perf/rollout_s": 3.0, "perf/update_s": 1.0, "rewards/f/mean": 0.5, '
        '"rewards/f/std": ' + "1" + "0" * 400 + "}",  # an int past any float: json reads it as an int
        '{"step": ' + "1" + "0" * 400 + ', "perf/step_s": 1.0}',  # a step no curve can place: the row is left out
        '{"step": 4, "perf/step_s": ' + "9" * 5000 + "}",  # past the digits json reads: dropped as a broken line
        '{"step": 5, "perf/step_s": ' + "[" * 100_000 + "]" * 100_000 + "}",  # nested past the stack: dropped too
        {"step": 3, "perf/step_s": 2.0, "perf/rollout_s": 1.0, "perf/update_s": 1.0, "perf/peak_rss_gb": [2.0]}])
    with caplog.at_level("WARNING", logger="trainer.run_report"):
        report = write_run_report(tmp_path, results={"grpo": {}}).read_text().splitlines()
    assert "| grpo | - | 3 | 1.5 (process RSS) | score_policy - | score_policy - |" in report  # steps 2 and 3
    assert "| grpo | 2 | 4 | 2 | 1 (50%) | 1 (50%) | - | - |" in report  # step 1's time is a string
    assert "| grpo | f | - ± 0.1 (step 1) | 0.5 ± - (step 2) |" in report
    assert (tmp_path / "curves.png").stat().st_size > 0
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"{tmp_path / 'grpo' / 'metrics.jsonl'}: 6 value(s) that are not numbers skipped (step 1: "
                        "'perf/step_s' = 'fast'); the report shows them as missing"]


def test_odd_values_in_a_stages_results_show_as_missing(tmp_path):
    from trainer.run_report import write_run_report

    (tmp_path / "reward").mkdir()
    (tmp_path / "reward" / "results.json").write_text(
        '{"seconds": "slow", "eval_before": [0.5], "eval_after": {"eval/accuracy": 0.75, "eval/pairs": Infinity}}')
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "results.json").write_text(
        '{"seconds": 3.0, "eval_before": {"eval/perplexity": "big"}, "eval_after": {"eval/perplexity": 1' + "0" * 400
        + "}}")
    report = write_run_report(tmp_path).read_text().splitlines()
    assert "| sft | 3 | - | - | perplexity - | perplexity - |" in report
    assert "| reward | - | - | - | accuracy - | accuracy 0.75 |" in report  # no pair count: no interval


def one_line_error(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, the one `error: ` line) of `python -m trainer.run_report ARGV`, run in this process."""
    from foundation.cli import run
    from trainer.run_report import main

    with pytest.raises(SystemExit) as exit_info:
        run(main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return exit_info.value.code, lines[0]


def test_a_results_or_comparison_file_that_is_not_a_json_object_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "sft").mkdir()
    results = tmp_path / "sft" / "results.json"
    for text, problem in (("[1, 2]", "a JSON list, not the object a run writes there"),
                          ('{"stage": "sft", ', "not a readable JSON file (JSONDecodeError"),
                          ('"done"', "a JSON str, not the object")):
        results.write_text(text)
        code, line = one_line_error([str(tmp_path)], capsys)
        assert code == 1 and line.startswith(f"error: {results}: {problem}"), line
    results.write_text('{"stage": "sft"}')
    comparison = tmp_path / "comparison.json"
    comparison.write_text('{"prompts": 4, "policies": {"sft": {"mean_score": "high"}}}')
    code, line = one_line_error([str(tmp_path)], capsys)
    assert code == 1 and line.startswith(f"error: {comparison}: not as trainer.compare writes it (ValueError")
    assert not (tmp_path / "report.md").exists()


def test_a_run_dir_that_holds_no_run_is_refused_in_one_line_and_nothing_is_created(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "run" / "sft").mkdir(parents=True)
    (tmp_path / "run" / "sft" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n')
    hint = "give the folder a pipeline run wrote (its --run_dir, e.g. runs/demo)"
    assert one_line_error(["runs/dmeo"], capsys) == (1, f"error: runs/dmeo: no such folder; {hint}")
    assert one_line_error([str(a_file)], capsys) == (1, f"error: {a_file}: not a folder; {hint}")
    assert one_line_error(["empty"], capsys) == (
        1, f"error: empty: holds no run (no stage folder with metrics.jsonl, results.json or config.json in it); "
           f"{hint}")
    assert one_line_error(["run/sft"], capsys) == (
        1, f"error: run/sft: one stage's folder (it holds metrics.jsonl); the report is of the run folder that holds "
           f"the stage folders: give {tmp_path / 'run'}")
    assert one_line_error([], capsys) == (2, "error: the following arguments are required: RUN_DIR")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["empty", "metrics.jsonl", "notes.txt", "run", "sft"]


def test_the_command_prints_its_usage_for_help_and_writes_the_report_of_a_run(tmp_path, capsys, monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from foundation.cli import run
    from trainer.run_report import main

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    helped = subprocess.run([sys.executable, "-m", "trainer.run_report", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, env=env, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m trainer.run_report [-h] RUN_DIR")
    assert list(tmp_path.iterdir()) == []  # no ./--help/report.md
    monkeypatch.chdir(tmp_path)
    write_metrics(tmp_path / "run" / "sft", [{"step": 1, "train/loss": 2.0, "perf/step_s": 1.5}])
    assert run(main, ["run"]) == Path("run/report.md") and capsys.readouterr().out == "run/report.md\n"
    assert "![training curves](curves.png)" in (tmp_path / "run" / "report.md").read_text()
