"""Markdown for a ppo_vs_trl.json: provenance, the work, what each side was, and the comparison.

A file holds one device kind: a CPU report shows peak resident set and says it is no GPU figure;
a CUDA report shows allocator peaks. The two are never put in one table.
"""

from __future__ import annotations

from typing import Optional

from foundation.provenance import shown_command
from profiling.report import table_lines

GIB = 2**30


def _num(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _gib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def _ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def result_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(figure, ours, TRL, TRL / ours) rows for the device kind of `report`."""
    sides = report["sides"]
    ours = sides.get("ours", {}).get("summary", {})
    trl = sides.get("trl", {}).get("summary", {})
    r = report.get("ratios", {})
    rows = [("whole PPO step (s)", _num(ours.get("step_s")), _num(trl.get("step_s")), _ratio(r.get("step_time_speedup"))),
            ("rollout (s)", _num(ours.get("rollout_s")), _num(trl.get("rollout_s")), _ratio(r.get("rollout_speedup"))),
            ("  of which generation (s)", _num(ours.get("generate_s")), _num(trl.get("generate_s")),
             _ratio(r.get("generation_speedup"))),
            ("update (s)", _num(ours.get("update_s")), _num(trl.get("update_s")), _ratio(r.get("update_speedup"))),
            ("rollout tokens/s (generated)", _num(ours.get("rollout_tokens_per_s"), "{:.1f}"),
             _num(trl.get("rollout_tokens_per_s"), "{:.1f}"), _ratio(r.get("rollout_speedup"))),
            ("generation tokens/s", _num(ours.get("generate_tokens_per_s"), "{:.1f}"),
             _num(trl.get("generate_tokens_per_s"), "{:.1f}"), _ratio(r.get("generation_speedup"))),
            ("update tokens/s (prompt + response, x epochs)", _num(ours.get("update_tokens_per_s"), "{:.1f}"),
             _num(trl.get("update_tokens_per_s"), "{:.1f}"), _ratio(r.get("update_speedup")))]
    if report["device_kind"] != "cuda":
        rows += [("whole PPO step, process CPU time (s)", _num(ours.get("step_cpu_s")), _num(trl.get("step_cpu_s")),
                  _ratio(r.get("step_cpu_time_speedup"))),
                 ("rollout, process CPU time (s)", _num(ours.get("rollout_cpu_s")), _num(trl.get("rollout_cpu_s")),
                  _ratio(r.get("rollout_cpu_time_speedup"))),
                 ("update, process CPU time (s)", _num(ours.get("update_cpu_s")), _num(trl.get("update_cpu_s")),
                  _ratio(r.get("update_cpu_time_speedup")))]
    if report["device_kind"] == "cuda":
        rows += [("peak allocated (GiB)", _gib(ours.get("peak_allocated_bytes")), _gib(trl.get("peak_allocated_bytes")),
                  _ratio(r.get("peak_allocated_trl_over_ours"))),
                 ("peak reserved (GiB)", _gib(ours.get("peak_reserved_bytes")), _gib(trl.get("peak_reserved_bytes")),
                  _ratio(r.get("peak_reserved_trl_over_ours"))),
                 ("NVML device used, max at phase ends (GiB)", _gib(ours.get("nvml_used_max_bytes")),
                  _gib(trl.get("nvml_used_max_bytes")), "")]
    else:
        rows += [("peak RSS, CPU (GiB)", _gib(ours.get("peak_rss_bytes")), _gib(trl.get("peak_rss_bytes")),
                  _ratio(r.get("peak_rss_trl_over_ours"))),
                 ("peak RSS above the side's start (GiB)", _gib(ours.get("peak_rss_above_start_bytes")),
                  _gib(trl.get("peak_rss_above_start_bytes")), _ratio(r.get("peak_rss_above_start_trl_over_ours")))]
    rows.append(("optimizer steps per PPO step", _num(ours.get("optimizer_steps"), "{:.1f}"),
                 _num(trl.get("optimizer_steps"), "{:.1f}"), ""))
    rows.append(("trainable parameters", _count(sides.get("ours")), _count(sides.get("trl")), ""))
    return rows


def _load(value) -> str:
    return "n/a" if not value else f"{value[0]:.1f}"


def _count(side: Optional[dict]) -> str:
    n = (side or {}).get("setup", {}).get("trainable_parameters")
    return "n/a" if n is None else f"{n:,}"


def render_markdown(report: dict) -> str:
    s = {**report["settings"], **report.get("resolved", {})}
    cuda = report["device_kind"] == "cuda"
    lines = [f"# PPO step: ours vs TRL {report.get('trl_version')} ({'GPU' if cuda else 'CPU'})", ""]
    if not cuda:
        lines += ["CPU figures: peak memory is the process's resident set, not GPU memory; compare these "
                  "ratios only with other CPU runs.", ""]
    lines += [f"- device: {report['device_name']} (`{report['device']}`)"
              + (f", capped at {report['simulated_gpu_gib']:g} GiB (simulated card)"
                 if cuda and report.get("simulated_gpu_gib") else ""),
              f"- date: {report['date']}", f"- git revision: `{report['git_revision']}`",
              f"- command: `{shown_command(report)}`",
              f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items() if v)}, trl {report.get('trl_version')}",
              "",
              "## The work (identical on both sides)", "",
              f"{s['model_name_or_path']} (quantization {s['quantization']}, dtype {s['dtype']}, attention "
              f"{s['attn_implementation']}, mixed precision {report['mixed_precision']}); LoRA r={s['lora_r']}, alpha={s['lora_alpha']}, {s['lora_target_modules']}; "
              f"{s['rollout_batch_size']} hh-rlhf prompts of exactly {s['prompt_length']} tokens per step, "
              f"{s['max_new_tokens']} sampled tokens each (no early stop, temperature {s['temperature']}); "
              f"generation / scoring {s['rollout_micro_batch_size']} rows at a time; {s['ppo_epochs']} PPO epochs of "
              f"minibatches of {s['mini_batch_size']}, micro-batches of {s['micro_batch_size']}; lr {s['learning_rate']}, "
              f"optimizer {s['optimizer']}; gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}; "
              f"{s.get('warmup_runs', s.get('warmup_steps'))} warm-up step(s) then {s['steps']} measured step(s) per "
              "side" + (f", in each of {s['rounds']} rounds (the order of the sides reversed every other round)"
                        if s.get("rounds", 1) > 1 else "") + ".", ""]
    lines += ["## Results", "", *table_lines([None, "ours", "TRL", "TRL / ours"], "lrrr", result_rows(report))]
    lines += ["", "TRL / ours above 1 means ours is faster (times) or lighter (memory). Times are means over the "
              "measured steps; peaks are over all steps, model loading excluded."]
    if not cuda:
        loads = {n: (side.get("load_average_at_start"), side.get("load_average_at_end"))
                 for n, side in report["sides"].items()}
        lines += ["", "On a CPU shared with other jobs the wall times stretch with their load; the process CPU "
                  "time (all of this process's threads) is the steadier comparison. 1-minute load average "
                  "at the start / end of each side: "
                  + "; ".join(f"{n} {_load(a)} / {_load(b)}" for n, (a, b) in loads.items()) + "."]
    lines += round_lines(report)
    lines += ablation_lines(report)
    for name, side in report["sides"].items():
        lines += ["", f"## {side['label']}: status {side['status']}", ""]
        if side.get("error"):
            lines += [f"Error: `{side['error']}`", ""]
        for key, value in side.get("setup", {}).items():
            if key != "ppo_config":
                lines.append(f"- {key}: {value}")
        graphs = [r.get("compiled_graphs") for r in side.get("rounds", [side])]
        if any(graphs):
            lines.append("- graphs torch.compile compiled during the side: " + ", ".join(
                f"round {i} {g}" for i, g in enumerate(graphs, start=1) if g is not None))
        elif graphs and all(g == 0 for g in graphs):
            lines.append("- graphs torch.compile compiled during the side: none")
        if "ppo_config" in side.get("setup", {}):
            lines.append(f"- PPOConfig: {side['setup']['ppo_config']}")
    lines += ["", "## What is timed", "",
              "- ours: `trainer.rl.online.rl_step` with `PPO`, the step `trainer/ppo.py` trains with; rollout = up to "
              "its update phase (generate; policy, reward, reference, value passes; advantages), update = the PPO "
              "epochs and the KL controller.",
              "- TRL: a step runs from one `on_step_end` callback to the next (the first from `on_train_begin`); "
              "rollout = up to the first update forward (generation, reference / value / reward passes, GAE and "
              "whitening, and TRL's `empty_cache` / `gc.collect` calls), update = the PPO epochs plus TRL's "
              "metric gathering and logging. Generation = time inside TRL's `batch_generation`.",
              "- Every boundary synchronizes the device. TRL's policy log-probs come from the logits it keeps "
              "while generating; ours as each side's `old log-probs` line above says."]
    return "\n".join(lines) + "\n"


def round_lines(report: dict) -> list[str]:
    """With several rounds: each round's order and mean step time per side, and its TRL / ours ratio (how much
    the ratio moves between rounds is how far one ordering of the sides can be trusted on this machine)."""
    rounds = report.get("rounds") or []
    if len(rounds) < 2:
        return []
    names = list(report["sides"])
    rows = []
    for r in rounds:
        times = r["step_s"]
        ratio = times["trl"] / times["ours"] if times.get("trl") and times.get("ours") else None
        rows.append([r["round"], ", ".join(r["order"]), *(_num(times.get(n)) for n in names), _ratio(ratio)])
    return ["", "## Rounds (the figures above are over all of them)", "",
            *table_lines(["round", "order", *(f"{n} step (s)" for n in names), "TRL / ours"],
                         "rl" + "r" * (len(names) + 1), rows)]


def ablation_lines(report: dict) -> list[str]:
    """A table of our side against each of its ablations run in the same command (ablation / ours:
    above 1, the ablated feature saves that much), and one of TRL's side against its variants."""
    return _variant_lines(report, "ours", "Ablations of ours") + _variant_lines(report, "trl", "Variants of TRL's side")


def _variant_lines(report: dict, main: str, title: str) -> list[str]:
    sides = report["sides"]
    ours = sides.get(main, {}).get("summary", {})
    ablations = [n for n in sides if n.startswith(main + "_")]
    if not ours or not ablations:
        return []
    figures = [("whole PPO step (s)", "step_s"), ("rollout (s)", "rollout_s"), ("  of which generation (s)", "generate_s"),
               ("update (s)", "update_s"), ("whole PPO step, process CPU time (s)", "step_cpu_s")]
    memory = "peak_allocated_bytes" if report["device_kind"] == "cuda" else "peak_rss_bytes"
    rows = [[label, *(_num(s.get("summary", {}).get(key)) for s in [sides[main]] + [sides[n] for n in ablations])]
            for label, key in figures]
    rows.append([f"peak {'allocated' if memory == 'peak_allocated_bytes' else 'RSS'} (GiB)",
                 *(_gib(s.get("summary", {}).get(memory)) for s in [sides[main]] + [sides[n] for n in ablations])])
    return ["", f"## {title} (same command, same work)", "",
            *table_lines([None, main, *ablations], "lr" + "r" * len(ablations), rows)]
