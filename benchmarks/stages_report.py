"""Markdown for a `benchmarks.stages_vs_trl` result: one run's report."""

from __future__ import annotations

from typing import Optional

from foundation.provenance import shown_command
from profiling.report import table_lines

GB = 1e9
METRIC = {"sft": ("perplexity", "held-out completion perplexity (lower is better)"),
          "reward": ("accuracy", "held-out pairwise accuracy"),
          "dpo": ("rewards/accuracies", "held-out implicit-reward accuracy")}


def _f(value: Optional[float], fmt: str = ".3f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def quality(report: dict, side: dict) -> str:
    """The held-out figure with its 95% interval (Wilson for an accuracy, bootstrap over rows for perplexity)."""
    ev = side.get("evaluation") or {}
    key = METRIC[report["stage"]][0]
    if key not in ev:
        return "-"
    if "accuracy_ci95" in ev:
        lo, hi = ev["accuracy_ci95"]
        return f"{ev[key]:.3f} [{lo:.3f}, {hi:.3f}] on {int(ev['pairs'])} pairs"
    lo, hi = ev.get("perplexity_ci95") or (None, None)
    span = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
    return f"{ev[key]:.3f}{span} on {ev.get('rows', '-')} rows ({int(ev.get('tokens', 0))} tokens)"


def _computed(m: dict) -> str:
    if m.get("computed_tokens_per_step") is None:
        return "-"
    return f"{m['computed_tokens_per_step']:.0f} ({m['computed_over_real_tokens']:.2f}x)"


def render_markdown(report: dict) -> str:
    stage, s = report["stage"], report["settings"]
    unit = "rows" if stage == "sft" else "pairs"
    train, data, model = s["train"], s["data"], s["model"]
    lines = [f"# {stage}: ours vs TRL {report.get('trl_version')} on the same work", "",
             f"- device: {report['device']} ({report.get('device_name')}); {report['date']}; revision "
             f"{report.get('git_revision')}",
             f"- command: `{shown_command(report)}`",
             f"- model {model['model_name_or_path']} (quantization {model['quantization']}), LoRA r={model['lora_r']} "
             f"alpha={model['lora_alpha']} dropout={model['lora_dropout']} {model['lora_target_modules']}",
             f"- {train['max_steps']} optimizer steps of {train['micro_batch_size']} x "
             f"{train['gradient_accumulation_steps']} {unit} ({report['rows']['train_rows']} {unit}, the same ones in "
             f"the same order on both sides), max_length {data['max_length']}, lr {train['learning_rate']} (warmup "
             f"{train['warmup_steps']}, cosine to {train['min_lr_ratio']}x), AdamW, max_grad_norm {train['max_grad_norm']}"
             + (f", beta {s['bench']['beta']}" if stage == "dpo" else ""),
             f"- real tokens per step: {report['rows']['tokens_per_step_mean']:.0f} on average (the same rows on both "
             f"sides); timings over the steps after the first {s['bench']['warmup_runs']}",
             f"- quality: {METRIC[stage][1]} on the held-out split (eval_size {data['eval_size']}, split_seed "
             f"{data['split_seed']}), both adapters scored by the same code (trainer.evaluate)"
             + (f"; re-scored on {report['rescored']['date']} at revision {report['rescored']['git_revision']} by "
                f"`{report['rescored']['command']}`" if report.get("rescored") else ""), ""]
    rows = []
    for side in report["sides"].values():
        m = side.get("summary") or {}
        rows.append([side.get("label", side["side"]), side["status"], side.get("rows_as_planned"),
                     quality(report, side), _f(m.get("step_s"), ".2f"), _f(m.get("step_cpu_s"), ".2f"),
                     _f(m.get("tokens_per_s"), ".0f"), _computed(m), _f(m.get("peak_rss_bytes"), ".2f", GB),
                     _f(m.get("peak_rss_above_start_bytes"), ".2f", GB), _f(m.get("peak_allocated_bytes"), ".2f", GB)])
    lines += table_lines(["side", "status", "rows as planned", "held-out", "step s (mean)", "CPU s / step", "tokens/s",
                          "computed tokens / step (x real)", "peak RSS GB", "peak RSS above start GB",
                          "peak allocated GB"], "l" * 11, rows)
    r = report.get("ratios")
    if r:
        lines += ["", f"Ours vs TRL: step time {_f(r['step_time_speedup'], '.2f')}x faster, CPU time "
                      f"{_f(r['step_cpu_time_speedup'], '.2f')}x, tokens/s {_f(r['tokens_per_s_ratio'], '.2f')}x; TRL "
                      f"computes {_f(r.get('computed_tokens_trl_over_ours'), '.2f')}x the tokens ours does; TRL's "
                      f"peak RSS over ours {_f(r['peak_rss_trl_over_ours'], '.2f')}x (above start "
                      f"{_f(r['peak_rss_above_start_trl_over_ours'], '.2f')}x)."]
    lines += memory_lines(report)
    for side in report["sides"].values():
        if side.get("error"):
            lines += ["", f"{side['side']} failed: {side['error']}"]
        if side.get("setup"):
            lines += ["", f"**{side.get('label', side['side'])}**: " + "; ".join(
                f"{k}: {v}" for k, v in side["setup"].items() if k != "argv")]
    return "\n".join(lines) + "\n"


def memory_lines(report: dict) -> list[str]:
    """With `--profile_memory true`: each side's tensors by component (the same walk on both sides), the bytes saved
    for backward over one optimizer step's micro-batches, and what of the peak RSS neither accounts for (the
    backward's temporaries, the runtime, the heap's slack)."""
    sides = {n: s for n, s in report["sides"].items() if s.get("memory")}
    if not sides:
        return []
    components = sorted({c for s in sides.values() for c in s["memory"]["resident"]})
    mib = 2**20

    def cell(value: Optional[float]) -> str:
        return "-" if value is None else f"{value / mib:.0f}"

    resident = {n: sum(s["memory"]["resident"].values()) for n, s in sides.items()}
    saved = {n: s["memory"].get("saved_for_backward") for n, s in sides.items()}
    peaks = {n: (s.get("summary") or {}).get("peak_rss_bytes") for n, s in sides.items()}
    rest = {n: peaks[n] - resident[n] - (saved[n] or 0) if peaks[n] is not None else None for n in sides}
    rows = [[c, *(cell(s["memory"]["resident"].get(c, 0)) for s in sides.values())] for c in components]
    rows += [[label, *(cell(figure[n]) for n in sides)] for label, figure in (
        ("**tensors alive**", resident), ("saved for backward, first step's micro-batches", saved),
        ("peak RSS", peaks), ("peak RSS less both (temporaries, runtime, heap)", rest))]
    return ["", "## Tensor-counted memory (MiB; `--profile_memory true`)", "",
            *table_lines([None, *(s.get("label", n) for n, s in sides.items())], "l" + "r" * len(sides), rows)]
