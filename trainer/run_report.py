"""The run report: one Markdown page and a PNG of curves for a pipeline run folder.

Everything in it is read from files the stages wrote (results.json, metrics.jsonl, memory.json,
comparison.json), so the page can be regenerated at any time:

    python -m trainer.run_report runs/demo

A metrics value that is not a number (a string, an integer past any float) is left out and shown as missing;
a file that is not what its stage writes (results.json not a JSON object) stops the report in one line.
"""

from __future__ import annotations

import io
import json
import logging
import math
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from foundation.cli import InputError, argument_parser, run
from foundation.files import reported_write_failure, write_atomic
from trainer.config import PIPELINE_STAGES
from trainer.engine.metrics import METRICS_FILE, read_metrics

logger = logging.getLogger("trainer.run_report")  # the same name under `python -m`

REPORT = "report.md"
CURVES = "curves.png"
RESULTS = "results.json"
COMPARISON = "comparison.json"
RUN_FILES = (METRICS_FILE, RESULTS, "config.json")  # what a stage's folder holds once it has started


def is_number(value: Any) -> bool:
    """A JSON value a table can print and a curve can plot: an int or float (NaN and inf included, as a run
    logs them), not a bool, a string, or an int past any float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def numeric_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """`rows` with only their numbers, and what was left out ("step 3: 'perf/step_s' = 'fast'"); a row whose
    step is not a number is left out whole."""
    kept, odd = [], []
    for row in rows:
        if not is_number(row["step"]):
            odd.append(f"a row with step {_shown(row['step'])}")
            continue
        kept.append({k: v for k, v in row.items() if is_number(v)})
        odd += [f"step {row['step']}: {k!r} = {_shown(v)}" for k, v in row.items() if not is_number(v)]
    return kept, odd


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text):,} characters)"


def stage_metrics(run_dir: Path, stage: str) -> list[dict]:
    """A stage's metrics.jsonl rows, numbers only (see `numeric_rows`)."""
    return numeric_rows(read_metrics(run_dir / stage))[0]


def warn_odd_metrics(run_dir: Path, stages: Sequence[str]) -> None:
    """One warning per metrics.jsonl the report reads that holds values it leaves out, naming the first."""
    for stage in dict.fromkeys([*stages, *(panel[0] for panel in PANELS)]):
        odd = numeric_rows(read_metrics(run_dir / stage))[1]
        if odd:
            logger.warning("%s: %d value(s) that are not numbers skipped (%s); the report shows them as missing",
                           run_dir / stage / METRICS_FILE, len(odd), odd[0])


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object, or one InputError line naming it."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8, an int past 4300 digits
        raise InputError(f"{path}: not a readable JSON file ({type(exc).__name__}: {str(exc)[:160]})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: a JSON {type(value).__name__}, not the object a run writes there; "
                         "rerun its stage or move the file away")
    return value


@contextmanager
def written_by(path: Path, writer: str) -> Iterator[None]:
    """A saved file whose contents do not have the shape `writer` gives them stops the report in one line."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        raise InputError(f"{path}: not as {writer} writes it ({type(exc).__name__}: {str(exc)[:160]}); "
                         f"rerun {writer} or move the file away") from None


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    picked = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in picked], [v for _, v in picked]


PANELS = [  # (stage, title, [(metric, label)])
    ("sft", "SFT", [("train/loss", "train loss"), ("eval/loss", "held-out loss")]),
    ("reward", "Reward model", [("train/accuracy", "train accuracy"), ("eval/accuracy", "held-out accuracy")]),
    ("ppo", "PPO", [("objective/scores", "reward score"), ("objective/kl", "KL to reference")]),
    ("grpo", "GRPO", [("objective/scores", "reward score"), ("kl", "KL to reference")]),
    ("rloo", "RLOO", [("objective/scores", "reward score"), ("kl", "KL to reference")]),
    ("dpo", "DPO", [("train/rewards/accuracies", "train implicit-reward acc."), ("eval/rewards/accuracies", "held-out acc.")]),
]


def plot_curves(run_dir: Path) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(stage, title, keys, stage_metrics(run_dir, stage)) for stage, title, keys in PANELS]
    panels = [p for p in panels if p[3]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (stage, title, keys, rows) in zip(axes[0], panels):
        for key, label in keys:
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.lines:  # a stage with metrics but none of its panel's yet (a run cut early) has no legend to draw
            ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    out = run_dir / CURVES
    with reported_write_failure(str(out), run_dir):
        return write_atomic(out, png.getvalue())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def step_costs(rows: list[dict]) -> tuple[str, str]:
    """(mean seconds per training step, peak memory in GB with its kind) from a stage's metrics.jsonl rows."""
    seconds = [r["perf/step_s"] for r in rows if "perf/step_s" in r]
    peaks = [(v, k.split("_")[1]) for r in rows for k, v in r.items() if k.startswith("perf/peak_") and k.endswith("_gb")]
    step = f"{sum(seconds) / len(seconds):.3g}" if seconds else "-"
    if not peaks:
        return step, "-"
    value, kind = max(peaks)
    return step, f"{value:.3g} ({'process RSS' if kind == 'rss' else 'GPU allocated'})"


def stage_table(results: dict[str, dict], run_dir: Optional[Path] = None) -> list[str]:
    """One row per stage: time, mean step time and peak memory (from its metrics, when `run_dir` is given),
    and the held-out figure before and after training."""
    lines = ["| stage | time (s) | mean step (s) | peak memory (GB) | held-out before | held-out after |",
             "|---|---:|---:|---:|---|---|"]
    key_of = {"sft": "eval/perplexity", "reward": "eval/accuracy", "ppo": "eval/score_policy",
              "grpo": "eval/score_policy", "rloo": "eval/score_policy", "dpo": "eval/rewards/accuracies"}
    for name, res in results.items():
        key = key_of.get(name, "")
        before = (res.get("eval_before") or {}).get(key)
        after = (res.get("eval_after") or {}).get(key)
        label = key.split("/", 1)[-1]
        seconds = _fmt(res["seconds"]) if "seconds" in res else "-"  # only the pipeline times a stage
        step, peak = step_costs(stage_metrics(run_dir, name)) if run_dir is not None else ("-", "-")
        lines.append(f"| {name} | {seconds} | {step} | {peak} | {label} {_fmt(before)}{_interval(before, res.get('eval_before'))} | "
                     f"{label} {_fmt(after)}{_interval(after, res.get('eval_after'))} |")
    return lines


def rl_time_table(run_dir: Path, stages: Sequence[str]) -> list[str]:
    """Where an online RL stage's step time went, from its metrics.jsonl `perf/` keys: the first step apart
    (a compiled decode compiles its step and captures its CUDA graphs there), then medians over the later steps
    of the step, its rollout and update (with their shares of the step), the rollout's decoded tokens per
    second and, on CUDA, that speed over the memory-bandwidth bound. Nothing when no stage was an RL one."""
    lines = []
    for stage in stages:
        rows = [r for r in stage_metrics(run_dir, stage) if "perf/rollout_s" in r and "perf/step_s" in r]
        if not rows:
            continue
        later = rows[1:] or rows

        def median(key: str) -> Optional[float]:
            values = [r[key] for r in later if key in r]
            return statistics.median(values) if values else None

        step, rollout, update = median("perf/step_s"), median("perf/rollout_s"), median("perf/update_s")
        tokens, bound = median("perf/decode_tokens_per_s"), median("perf/decode_bandwidth_fraction")
        shares = [f"{part:.3g} ({part / step:.0%})" if part is not None and step else "-"
                  for part in (rollout, update)]
        lines.append(f"| {stage} | {len(rows)} | {rows[0]['perf/step_s']:.3g} | {step:.3g} | {shares[0]} | "
                     f"{shares[1]} | {'-' if tokens is None else f'{tokens:.4g}'} | "
                     f"{'-' if bound is None else f'{bound:.1%}'} |")
    if not lines:
        return []
    return ["## Time per RL step", "", "The first step apart (a compiled decode compiles there); the other columns are "
            "medians over the later steps. Decoded tokens per second: the rollout's generated tokens over its "
            "generation time, the prompt pass included; the bound (CUDA only): the tokens per second of decode steps "
            "that each read the weights once at the device's copy bandwidth.", "",
            "| stage | steps | first step (s) | step (s) | rollout (s) | update (s) | decoded tokens/s | "
            "of the bandwidth bound |", "|---|---:|---:|---:|---:|---:|---:|---:|", *lines, ""]


def reward_function_table(run_dir: Path, stages: Sequence[str]) -> list[str]:
    """Each reward function's mean (and std) over a rollout batch at the first and last logged step of each RL
    stage, from its `rewards/NAME/mean` metrics; nothing when no stage was scored by reward functions."""
    lines = []
    for stage in stages:
        rows = [r for r in stage_metrics(run_dir, stage) if any(k.startswith("rewards/") for k in r)]
        names = sorted({k[len("rewards/"):-len("/mean")] for r in rows for k in r
                        if k.startswith("rewards/") and k.endswith("/mean")})
        for name in names:
            first, last = rows[0], rows[-1]
            cells = [f"{_fmt(r.get(f'rewards/{name}/mean'))} ± {_fmt(r.get(f'rewards/{name}/std'))} (step {r['step']})"
                     for r in (first, last)]
            lines.append(f"| {stage} | {name} | {cells[0]} | {cells[1]} |")
    if not lines:
        return []
    return ["## Reward functions", "", "Mean ± std over each step's responses (`rewards/NAME/mean` and `/std` in "
            "metrics.jsonl; a function's None values are left out).", "",
            "| stage | function | first step | last step |", "|---|---|---|---|", *lines, ""]


LENGTH_DRIFT = 0.5  # a trained policy's mean response length this far (as a fraction) from the start's is suspect


def reward_hacking_signs(stage: str, rows: list[dict]) -> list[str]:
    """What in an RL stage's evaluations (metrics.jsonl rows with `eval/kl`) looks like reward hacking: the
    policy's mean response length more than half away from the starting policy's at the last evaluation, or
    the KL to the reference rising at each of the last three evaluations while the held-out score falls
    over them (the last below the first)."""
    evals = [r for r in rows if "eval/kl" in r and "eval/score_policy" in r]
    if not evals:
        return []
    signs, last = [], evals[-1]
    start = last.get("eval/response_length_sft", evals[0].get("eval/response_length_policy"))
    now = last.get("eval/response_length_policy")
    if start and now is not None and abs(now - start) > LENGTH_DRIFT * start:
        signs.append(f"{stage}'s mean response length went from {start:.1f} to {now:.1f} tokens "
                     f"({(now - start) / start:+.0%}) by step {last['step']}")
    kl, score = ([r[k] for r in evals[-3:]] for k in ("eval/kl", "eval/score_policy"))
    if len(evals) >= 3 and kl[0] < kl[1] < kl[2] and score[2] < score[0]:
        signs.append(f"{stage}'s KL to the reference rose over its last three evaluations "
                     f"({' -> '.join(f'{v:.3g}' for v in kl)}) while the held-out score fell "
                     f"({' -> '.join(f'{v:.3g}' for v in score)})")
    return signs


def reward_hacking_line(run_dir: Path, stages: Sequence[str]) -> list[str]:
    """The report's one warning line (and a blank) when any RL stage shows a sign of reward hacking."""
    signs = [s for stage in stages for s in reward_hacking_signs(stage, stage_metrics(run_dir, stage))]
    if not signs:
        return []
    return [f"**Possible reward hacking:** {'; '.join(signs)}. Read the samples before trusting the scores.", ""]


def wilson_interval(accuracy: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a fraction measured on n pairs (sound near 0 and 1, unlike p +- 2 SE)."""
    denom = 1 + z * z / n
    center = (accuracy + z * z / (2 * n)) / denom
    half = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n)) / denom
    # at 0 and 1 the interval's end is exactly 0 or 1; rounding would step past it (-1.4e-17) or short of it
    low, high = max(center - half, 0.0), min(center + half, 1.0)
    return (0.0 if accuracy <= 0 else low), (1.0 if accuracy >= 1 else high)


def bootstrap_perplexity_interval(nll: Sequence[float], tokens: Sequence[int], resamples: int = 2000,
                                  seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile-bootstrap interval of a perplexity exp(sum nll / sum tokens) measured on rows: the rows are
    drawn with replacement `resamples` times (a fixed seed, so the same rows give the same interval)."""
    import numpy as np

    nll, tokens = np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    if nll.shape != tokens.shape or nll.size == 0:
        raise ValueError(f"need one token count per row's NLL and at least one row (got {nll.size}, {tokens.size})")
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, resamples, 256):  # in chunks: a (resamples, rows) index array can be large
        pick = rng.integers(0, nll.size, size=(min(256, resamples - start), nll.size))
        means.append(nll[pick].sum(axis=1) / np.maximum(tokens[pick].sum(axis=1), 1))
    low, high = np.quantile(np.concatenate(means), [(1 - level) / 2, (1 + level) / 2])
    return math.exp(low), math.exp(high)


def _interval(accuracy: Any, evaluation: Optional[dict]) -> str:
    """' (95% CI a-b, n pairs)' for a pairwise accuracy: is it above chance (0.5) or only noise?"""
    pairs = (evaluation or {}).get("eval/pairs", 0)
    if not isinstance(accuracy, float) or not 0 <= accuracy <= 1 or not is_number(pairs) or not 1 <= pairs < math.inf:
        return ""
    pairs = int(pairs)
    low, high = wilson_interval(accuracy, pairs)
    return f" (95% CI {low:.2f}-{high:.2f}, {pairs} pairs)"


def comparison_table(comparison: dict) -> list[str]:
    lines = ["| policy | mean reward-model score | win rate vs SFT | KL to SFT (nats) | mean length |",
             "|---|---:|---:|---:|---:|"]
    for name, p in comparison["policies"].items():
        lines.append(f"| {name} | {p['mean_score']:.4f} | {p['win_rate_vs_sft']:.3f} | {p['kl_to_sft']:.3f} | "
                     f"{p['mean_length']:.1f} |")
    return lines


def sample_table(comparison: dict) -> list[str]:
    names = list(comparison["policies"])
    lines = ["| prompt (end) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in comparison.get("samples", []):
        cells = [_cell(s["prompt"][-160:])] + [f"{_cell(s[n])} ({s[f'score_{n}']:.2f})" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def evaluation_table(run_dir: Path) -> list[str]:
    """The `evaluate --output_file` results saved in the stage folders (e.g. dpo/evaluation-eval.json)."""
    lines = []
    for path in sorted(run_dir.glob("*/evaluation*.json")):
        ev = read_json_object(path)
        with written_by(path, "trainer.evaluate"):
            accuracy = ev.get("accuracy", ev.get("rewards/accuracies"))
            if ev.get("task") == "exact_match":
                figure = ", ".join(f"{name} {c['mean']:.3f} (95% CI {c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}, "
                                   f"{c['rows']} rows)" for name, c in ev["checks"].items() if c["mean"] is not None)
            elif accuracy is None:
                figure = f"perplexity {ev['perplexity']:.4g}" if "perplexity" in ev else "-"
            else:
                low, high = ev["accuracy_ci95"]  # evaluate writes it beside every accuracy
                figure = f"accuracy {accuracy:.4g} (95% CI {low:.3f}-{high:.3f}, {int(ev['pairs'])} pairs)"
            lines.append(f"| {ev['task']} | {ev.get('split', 'all')} | {figure} | `{path.relative_to(run_dir)}` |")
    if not lines:
        return []
    return ["## Evaluations (`python -m trainer.evaluate`)", "", "| task | split | result | file |",
            "|---|---|---|---|", *lines, ""]


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def numeric_results(results: dict[str, Any]) -> dict[str, dict]:
    """Each stage's results with the figures the report reads (`seconds`, the values of `eval_before` and
    `eval_after`) kept only where they are numbers: an odd one shows as missing."""
    kept = {}
    for name, res in results.items():
        res = dict(res) if isinstance(res, dict) else {}
        for key in ("eval_before", "eval_after"):
            evaluation = res.get(key)
            res[key] = {k: v for k, v in evaluation.items() if is_number(v)} if isinstance(evaluation, dict) else None
        if not is_number(res.get("seconds")):
            res.pop("seconds", None)
        kept[name] = res
    return kept


def check_run_dir(run_dir: Path) -> None:
    """Refuse, in one line, a RUN_DIR that is not a run folder: missing, a file, one stage's own folder, or a
    folder with no stage folder in it (a stage folder holds metrics.jsonl, results.json or config.json)."""
    hint = "give the folder a pipeline run wrote (its --run_dir, e.g. runs/demo)"
    if not run_dir.exists():
        raise InputError(f"{run_dir}: no such folder; {hint}")
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: not a folder; {hint}")
    own = [name for name in (METRICS_FILE, RESULTS) if (run_dir / name).is_file()]
    if own:
        raise InputError(f"{run_dir}: one stage's folder (it holds {own[0]}); the report is of the run folder that "
                         f"holds the stage folders: give {run_dir.resolve().parent}")
    stages = [d for d in run_dir.iterdir() if d.is_dir() and any((d / name).is_file() for name in RUN_FILES)]
    if not stages and not (run_dir / COMPARISON).is_file():
        raise InputError(f"{run_dir}: holds no run (no stage folder with {', '.join(RUN_FILES[:-1])} or "
                         f"{RUN_FILES[-1]} in it); {hint}")


def write_run_report(run_dir: Path, results: Optional[dict] = None, comparison: Optional[dict] = None) -> Path:
    run_dir = Path(run_dir)
    if results is None:
        order = {name: i for i, name in enumerate(PIPELINE_STAGES)}  # pipeline order
        found = sorted(run_dir.glob(f"*/{RESULTS}"), key=lambda p: (order.get(p.parent.name, 99), p.parent.name))
        results = {p.parent.name: read_json_object(p) for p in found}
    results = numeric_results(results)
    if comparison is None and (run_dir / COMPARISON).is_file():
        comparison = read_json_object(run_dir / COMPARISON)
    warn_odd_metrics(run_dir, list(results))
    curves = plot_curves(run_dir)
    from foundation.provenance import provenance

    prov = provenance(None)
    lines = [f"# Run report: {run_dir}", "",
             f"Generated {prov['date']} on {prov['device_name']}, git `{prov['git_revision']}`, "
             f"from the files in this folder (`python -m trainer.run_report {run_dir}`).", "",
             *reward_hacking_line(run_dir, list(results)), "## Stages", "", *stage_table(results, run_dir), ""]
    if any("process RSS" in line for line in lines):
        lines += ["On a CPU the peak memory is the process's resident set since it started: where stages ran in one "
                  "process (`trainer.pipeline`), a stage's figure includes the stages before it.", ""]
    lines += rl_time_table(run_dir, list(results))
    lines += reward_function_table(run_dir, list(results))
    dpo_before = (results.get("dpo") or {}).get("eval_before") or {}
    if dpo_before.get("eval/rewards/margins") == 0.0:
        lines += ["DPO starts with the policy equal to the reference, so every implicit reward is exactly 0 before "
                  "training: those ties count as wrong, hence accuracy 0, not 0.5.", ""]
    lines += evaluation_table(run_dir)
    timed = [r["seconds"] for r in results.values() if "seconds" in r]
    with written_by(run_dir / COMPARISON, "trainer.compare"):
        if comparison and "seconds" in comparison and len(timed) == len(results):
            total = sum(timed) + comparison["seconds"]
            lines += [f"The policy comparison below took {comparison['seconds']:.0f} s; stages and comparison "
                      f"together {total:.0f} s ({total / 60:.1f} min).", ""]
        if curves:
            lines += [f"![training curves]({curves.name})", ""]
        if comparison:
            lines += [f"## Policies on {comparison['prompts']} held-out prompts, scored by the reward model", "",
                      *comparison_table(comparison), "", "### Samples (reward-model score in brackets)", "",
                      *sample_table(comparison), ""]
    memory = [d for d in PIPELINE_STAGES if (run_dir / d / "memory.png").is_file()]
    if memory:
        lines += ["## Memory", ""] + [f"![{d} memory]({d}/memory.png) ([table]({d}/memory.md))" for d in memory] + [""]
    with reported_write_failure(str(run_dir / REPORT), run_dir):
        return write_atomic(run_dir / REPORT, "\n".join(lines))


def main(argv: Optional[list[str]] = None) -> Path:
    parser = argument_parser("python -m trainer.run_report", "Write report.md and curves.png of a pipeline run "
                             "folder from the files its stages wrote.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="The run folder (trainer.pipeline's --run_dir), e.g. runs/demo.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    check_run_dir(args.run_dir)
    report = write_run_report(args.run_dir)
    print(report)
    return report


if __name__ == "__main__":
    run(main)
