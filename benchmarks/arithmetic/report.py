"""The arithmetic task's result folder: held-out exact match before and after GRPO, from two
`trainer.evaluate exact_match` files and the GRPO run folder.

    python -m benchmarks.arithmetic.report --before B.json --after A.json --run runs/arithmetic/grpo \
        --out benchmarks/results/arithmetic-grpo-smollm2-135m-cpu

Writes arithmetic.json (both evaluations with their provenance, the run's settings and figures), README.md,
and the GRPO run's config, results and metrics under grpo/ with the run report (report.md, curves.png).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from foundation.cli import InputError, argument_parser, run
from foundation.files import write_atomic
from foundation.provenance import provenance, shown_command
from profiling.report import table_lines

ACCURACY, FORMAT = "correct", "formatted"  # the check functions of benchmarks/arithmetic/rewards.py
RUN_FILES = ("config.json", "results.json", "metrics.jsonl")
SHOWN = 8  # responses shown in the README


def _load(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable JSON file ({exc})") from None


def moved(before: dict, after: dict) -> str:
    """Whether a check's mean moved beyond its 95% interval: the two intervals apart, or only the new mean
    outside the old interval, or neither."""
    (lo0, hi0), (lo1, hi1) = before["ci95"], after["ci95"]
    if lo1 > hi0 or hi1 < lo0:
        return "apart"
    if not lo0 <= after["mean"] <= hi0:
        return "outside"
    return "within"


def verdict(name: str, before: dict, after: dict) -> str:
    """One honest sentence on a check's change."""
    change = f"{name} went from {before['mean']:.3f} to {after['mean']:.3f}"
    how = moved(before, after)
    if how == "apart":
        return f"{change}: the 95% intervals do not overlap, so it moved beyond its interval."
    if how == "outside":
        return (f"{change}: the new mean lies outside the starting 95% interval, but the two intervals overlap, "
                f"so the move is not clearly beyond noise.")
    return f"{change}: within the starting 95% interval, so it did not move beyond noise."


def answer_counts(evaluation: dict) -> Optional[Counter]:
    """How often each answer ('Answer: N' last line; None: none) was given, when the evaluation kept every
    response: a policy that collapsed to one answer shows here."""
    from benchmarks.arithmetic.rewards import parse_answer

    samples = evaluation.get("samples") or []
    if len(samples) < evaluation["rows"]:
        return None
    return Counter(parse_answer(s["response"]) for s in samples)


def described_counts(counts: Counter) -> str:
    """How many distinct answers, and the three given most often with their shares."""
    total = sum(counts.values())
    top = ", ".join(f"{'no answer line' if a is None else a} {n / total:.0%}" for a, n in counts.most_common(3))
    return f"{len(counts)} distinct; most often {top}"


def collapse(counts: Counter, share: float = 0.25) -> Optional[str]:
    """A sentence when one answer is given to at least `share` of the problems."""
    answer, n = counts.most_common(1)[0]
    if answer is None or n < share * sum(counts.values()):
        return None
    return (f"The trained policy answers {answer} to {n / sum(counts.values()):.0%} of the problems: much of what "
            f"it learned is the format, not the arithmetic.")


def _figure(check: dict, digits: int = 3) -> str:
    low, high = check["ci95"]
    return f"{check['mean']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def training_facts(run_dir: Path) -> dict:
    """The GRPO run's settings and what it logged: steps, seconds, reward functions at the first and last step."""
    config, results = _load(run_dir / "config.json"), _load(run_dir / "results.json")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward" in r]
    rewards = sorted({k for r in steps for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    return {"settings": {k: config[k] for k in ("model", "data", "train", "stage")},
            "steps": len(steps), "train_seconds": sum(r.get("perf/step_s", 0.0) for r in steps),
            "reward_first_last": {k: [steps[0][k], steps[-1][k]] for k in rewards} if steps else {},
            "eval_before": results.get("eval_before"), "eval_after": results.get("eval_after")}


def readme(result: dict) -> str:
    before, after, training = result["before"], result["after"], result["training"]
    stage, train = training["settings"]["stage"], training["settings"]["train"]
    rows = [("exact match (`correct`)", ACCURACY), ("format compliance (`formatted`)", FORMAT)]
    lines = ["# Arithmetic word problems: GRPO with reward functions on SmolLM2-135M-Instruct (CPU)", "",
             f"{before['rows']} held-out problems (`benchmarks.arithmetic.make_data --level one_digit`: one step, "
             "adding or taking away numbers under 10, after one worked example of the format, the answer asked "
             "for on a last line `Answer: N`), answered "
             f"greedily with at most {before['max_new_tokens']} new tokens before and after GRPO; 95% Wilson "
             "intervals in brackets.", ""]
    cells = [[label, _figure(before["checks"][name]), _figure(after["checks"][name])] for label, name in rows]
    cells.append(["mean response length (tokens)", _figure(before["mean_length"], 1), _figure(after["mean_length"], 1)])
    counts = [answer_counts(ev) for ev in (before, after)]
    if all(counts):
        cells.append(["answers given", *map(described_counts, counts)])
    lines += table_lines([None, "before (base model)", "after GRPO"], "lll", cells)
    lines += ["", verdict("Exact-match accuracy", before["checks"][ACCURACY], after["checks"][ACCURACY]),
              verdict("Format compliance", before["checks"][FORMAT], after["checks"][FORMAT])]
    if counts[1] and collapse(counts[1]):
        lines.append(collapse(counts[1]))
    lines += ["",
              "## Training", "",
              f"GRPO from the base model (no SFT), {training['steps']} steps of {stage['rollout_batch_size']} "
              f"prompts x {stage['num_generations']} responses ({stage['max_new_tokens']} new tokens at most, "
              f"temperature {stage['temperature']}), LoRA r={training['settings']['model']['lora_r']}, learning rate "
              f"{train['learning_rate']}, beta {stage['beta']}; {training['train_seconds'] / 60:.1f} min of steps. "
              f"Rewards: `{stage['reward_fn']}` weighted {stage['reward_weights']}.", "",
              *table_lines(["reward function", "first step mean", "last step mean"], "lll", [
                  [key.split("/")[1], f"{first:.3f}", f"{last:.3f}"]
                  for key, (first, last) in training["reward_first_last"].items()])]
    lines += ["", "The run report with the training curves: [grpo report](report.md).", "", "## Commands", "",
              "All of it: `bash benchmarks/arithmetic/recipe.sh` (make data, evaluate, GRPO, evaluate, this folder).",
              "", f"- before: `{shown_command(before['provenance'])}`",
              f"- after: `{shown_command(after['provenance'])}`",
              f"- this folder: `{shown_command(result['provenance'])}`", "",
              f"Evaluated {after['provenance']['date']} on {after['provenance']['device_name']}, git revision "
              f"`{after['provenance']['git_revision']}`.", "", "## Samples after GRPO", "",
              *table_lines(["answer", "response"], "ll", [[s.get("answer", ""), " ".join(
                  s["response"].replace("|", "/").split())] for s in after.get("samples", [])[:SHOWN]])]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    from trainer.run_report import write_run_report

    parser = argument_parser("python -m benchmarks.arithmetic.report", __doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="exact_match result of the starting policy.")
    parser.add_argument("--after", type=Path, required=True, help="exact_match result of the trained adapter.")
    parser.add_argument("--run", type=Path, required=True, help="The GRPO run folder.")
    parser.add_argument("--out", type=Path, required=True, help="The result folder to write.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    before, after = _load(args.before), _load(args.after)
    for name, ev in (("--before", before), ("--after", after)):
        if ev.get("task") != "exact_match" or ACCURACY not in ev.get("checks", {}) or FORMAT not in ev["checks"]:
            raise InputError(f"{name} {getattr(args, name[2:])}: not an exact_match result with the checks "
                             f"{ACCURACY} and {FORMAT}")
    result = {"before": before, "after": after, "training": training_facts(args.run), "provenance": provenance()}
    result["moved"] = {name: moved(before["checks"][name], after["checks"][name]) for name in (ACCURACY, FORMAT)}
    (args.out / "grpo").mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        shutil.copyfile(args.run / name, args.out / "grpo" / name)
    write_atomic(args.out / "arithmetic.json", json.dumps(result, indent=2))
    write_atomic(args.out / "README.md", readme(result))
    write_run_report(args.out, results={"grpo": _load(args.run / "results.json")})
    accuracy = [ev["checks"][ACCURACY]["mean"] for ev in (before, after)]
    print(f"wrote {args.out}: exact match {accuracy[0]:.3f} -> {accuracy[1]:.3f}")
    return result


if __name__ == "__main__":
    run(main)
