"""Markdown for `benchmarks.stages_vs_trl` results: one run's report, and the summary table of several runs."""

from __future__ import annotations

from typing import Optional

GB = 1e9
METRIC = {"sft": ("perplexity", "held-out completion perplexity (lower is better)"),
          "reward": ("accuracy", "held-out pairwise accuracy"),
          "dpo": ("rewards/accuracies", "held-out implicit-reward accuracy")}


def _f(value: Optional[float], fmt: str = ".3f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def quality(report: dict, side: dict) -> str:
    """The held-out figure, with its 95% interval where it is an accuracy."""
    ev = side.get("evaluation") or {}
    key = METRIC[report["stage"]][0]
    if key not in ev:
        return "-"
    if "accuracy_ci95" in ev:
        lo, hi = ev["accuracy_ci95"]
        return f"{ev[key]:.3f} [{lo:.3f}, {hi:.3f}] on {int(ev['pairs'])} pairs"
    return f"{ev[key]:.3f} ({int(ev.get('tokens', 0))} tokens, {ev.get('rows', '-')} rows)"


def render_markdown(report: dict) -> str:
    stage, s = report["stage"], report["settings"]
    train, data, model = s["train"], s["data"], s["model"]
    lines = [f"# {stage}: ours vs TRL {report.get('trl_version')} on the same work", "",
             f"- device: {report['device']} ({report.get('device_name')}); {report['date']}; revision "
             f"{report.get('git_revision')}",
             f"- command: `{report['command']}`",
             f"- model {model['model_name_or_path']} (quantization {model['quantization']}), LoRA r={model['lora_r']} "
             f"alpha={model['lora_alpha']} dropout={model['lora_dropout']} {model['lora_target_modules']}",
             f"- {train['max_steps']} optimizer steps of {train['micro_batch_size']} x "
             f"{train['gradient_accumulation_steps']} rows ({report['rows']['train_rows']} rows, the same rows in the "
             f"same order on both sides), max_length {data['max_length']}, lr {train['learning_rate']} (warmup "
             f"{train['warmup_steps']}, cosine to {train['min_lr_ratio']}x), AdamW, max_grad_norm {train['max_grad_norm']}"
             + (f", beta {s['bench']['beta']}" if stage == "dpo" else ""),
             f"- real tokens per step: {report['rows']['tokens_per_step_mean']:.0f} on average (the same rows on both "
             f"sides); timings over the steps after the first {s['bench']['warmup_runs']}",
             f"- quality: {METRIC[stage][1]} on the held-out split (eval_size {data['eval_size']}, split_seed "
             f"{data['split_seed']}), both adapters scored by the same code (trainer.evaluate)", "",
             "| side | status | rows as planned | held-out | step s (mean) | CPU s / step | tokens/s | peak RSS GB "
             "| peak RSS above start GB | peak allocated GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for side in report["sides"].values():
        m = side.get("summary") or {}
        lines.append(f"| {side.get('label', side['side'])} | {side['status']} | {side.get('rows_as_planned')} | "
                     f"{quality(report, side)} | {_f(m.get('step_s'), '.2f')} | {_f(m.get('step_cpu_s'), '.2f')} | "
                     f"{_f(m.get('tokens_per_s'), '.0f')} | {_f(m.get('peak_rss_bytes'), '.2f', GB)} | "
                     f"{_f(m.get('peak_rss_above_start_bytes'), '.2f', GB)} | {_f(m.get('peak_allocated_bytes'), '.2f', GB)} |")
    r = report.get("ratios")
    if r:
        lines += ["", f"Ours vs TRL: step time {_f(r['step_time_speedup'], '.2f')}x faster, CPU time "
                      f"{_f(r['step_cpu_time_speedup'], '.2f')}x, tokens/s {_f(r['tokens_per_s_ratio'], '.2f')}x; TRL's "
                      f"peak RSS over ours {_f(r['peak_rss_trl_over_ours'], '.2f')}x (above start "
                      f"{_f(r['peak_rss_above_start_trl_over_ours'], '.2f')}x)."]
    for side in report["sides"].values():
        if side.get("error"):
            lines += ["", f"{side['side']} failed: {side['error']}"]
        if side.get("setup"):
            lines += ["", f"**{side.get('label', side['side'])}**: " + "; ".join(
                f"{k}: {v}" for k, v in side["setup"].items() if k != "argv")]
    return "\n".join(lines) + "\n"


def render_table(reports: list[dict]) -> str:
    """One row per (stage, device) run: quality of both sides, speed and memory ratios."""
    lines = ["| stage | device | steps x rows | held-out: ours | held-out: TRL | step s ours / TRL | tokens/s ratio "
             "| peak RSS ours / TRL GB | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rep in sorted(reports, key=lambda r: ("sft", "reward", "dpo").index(r["stage"])):
        ours, trl = rep["sides"].get("ours", {}), rep["sides"].get("trl", {})
        mo, mt = ours.get("summary") or {}, trl.get("summary") or {}
        train = rep["settings"]["train"]
        lines.append(
            f"| {rep['stage']} | {rep['device_name']} | {train['max_steps']} x "
            f"{train['micro_batch_size'] * train['gradient_accumulation_steps']} | {quality(rep, ours)} | "
            f"{quality(rep, trl)} | {_f(mo.get('step_s'), '.2f')} / {_f(mt.get('step_s'), '.2f')} | "
            f"{_f((rep.get('ratios') or {}).get('tokens_per_s_ratio'), '.2f')}x | "
            f"{_f(mo.get('peak_rss_bytes'), '.2f', GB)} / {_f(mt.get('peak_rss_bytes'), '.2f', GB)} | "
            f"`{rep['command']}` ({rep['date'][:10]}, {rep.get('git_revision')}) |")
    return "\n".join(lines) + "\n"
