"""Our PPO step against TRL's PPOTrainer on the same work: a JSON + Markdown comparison.

    python -m benchmarks.ppo_vs_trl                                   # SmolLM2-135M, CPU or GPU

Both sides get the same weights, prompts, response length, batch sizes, PPO epochs, LoRA shape, optimizer,
dtype and reward head. Each side runs in a fresh process, in alternating order over `--rounds`, with
`warmup_runs` steps left out (docs/performance.md, "Method"). Writes ppo_vs_trl.json and ppo_vs_trl.md to
`out_dir`; each file holds one device.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from benchmarks.measure import log_to_stdout, release_memory, side_errors
from benchmarks.processes import CUT, EXIT_CUT, side_in_own_process
from benchmarks.workload import (
    TRL_SIDES, Workload, export_tokenizer, fixed_length_prompts, head_weights, hidden_size, load_bench_tokenizer,
    trl_batch_settings, write_heads,
)
from foundation.cli import run
from foundation.provenance import library_versions
from profiling.device import MemoryProbe

logger = logging.getLogger("benchmarks.ppo_vs_trl")
ROOT = Path(__file__).resolve().parent.parent
SIDE_NAMES = {"ours": "ours (one base, 4 adapters)", "trl": "TRL 1.12 PPOTrainer",
              "ours_eager_decode": "ours, ablation: each decode step run eagerly (--decode eager)",
              "ours_eager": "ours, ablation: decoder layers not compiled (--compile_layers false)",
              "trl_compiled": "TRL 1.12 PPOTrainer, its models' decoder layers compiled as --compile_layers compiles ours"}


def make_bench_accelerator(args: Workload, out_dir: str):
    """Our Accelerator, created before TRL's: TRL's `Accelerator()` then shares its mixed precision."""
    from dataclasses import replace

    from trainer.engine.launch import make_accelerator

    return make_accelerator(replace(args.train, output_dir=out_dir))


def summarize(side: dict, tokens: dict[str, int]) -> dict:
    """Means over the measured steps; peaks over every step (warm-up included, model loading excluded)."""
    measured = [s for s in side["steps"] if not s["warmup"]]
    if not measured:
        return {}

    def mean(key: str) -> Optional[float]:
        values = [s[key] for s in measured if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    out = {k: mean(k) for k in ("step_s", "rollout_s", "generate_s", "update_s", "step_cpu_s", "rollout_cpu_s",
                                "update_cpu_s", "optimizer_steps")}
    out["rollout_tokens_per_s"] = tokens["generated"] / out["rollout_s"]
    out["generate_tokens_per_s"] = tokens["generated"] / out["generate_s"] if out["generate_s"] else None
    out["update_tokens_per_s"] = tokens["update"] / out["update_s"]
    out["measured_steps"] = len(measured)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes"):
        values = [s["peak"][key] for s in side["steps"] if s["peak"].get(key) is not None]
        out[key] = max(values) if values else None
    out["nvml_used_max_bytes"] = side.get("nvml_used_max_bytes")
    # above the resident set at the start of the same round (a side's later rounds start where others left it)
    starts = {r["round"]: (r.get("at_start") or {}).get("rss_bytes") for r in side.get("rounds", [])}
    starts = starts or {None: (side.get("at_start") or {}).get("rss_bytes")}
    above = [s["peak"]["peak_rss_bytes"] - starts[s.get("round")] for s in side["steps"]
             if s["peak"].get("peak_rss_bytes") is not None and starts.get(s.get("round")) is not None]
    out["peak_rss_above_start_bytes"] = max(above) if above else None
    return out


def ratios(ours: dict, trl: dict) -> dict[str, Optional[float]]:
    """How many times faster / lighter ours is (TRL's figure over ours: > 1 means ours is better)."""
    def over(key: str) -> Optional[float]:
        a, b = ours.get(key), trl.get(key)
        return b / a if a and b else None

    return {"step_time_speedup": over("step_s"), "rollout_speedup": over("rollout_s"),
            "generation_speedup": over("generate_s"), "update_speedup": over("update_s"),
            "step_cpu_time_speedup": over("step_cpu_s"), "rollout_cpu_time_speedup": over("rollout_cpu_s"),
            "update_cpu_time_speedup": over("update_cpu_s"),
            "peak_allocated_trl_over_ours": over("peak_allocated_bytes"),
            "peak_reserved_trl_over_ours": over("peak_reserved_bytes"),
            "peak_rss_trl_over_ours": over("peak_rss_bytes"),
            "peak_rss_above_start_trl_over_ours": over("peak_rss_above_start_bytes")}


def run_side(name: str, args: Workload, prompts, tokenizer, accelerator, probe: MemoryProbe, heads) -> dict:
    result = {"side": name, "label": SIDE_NAMES[name], "status": "ok", "error": None, "steps": [], "setup": {}}
    release_memory()
    result["at_start"] = probe.now()
    result["load_average_at_start"] = os.getloadavg()  # other jobs on the machine stretch wall times
    graphs = compiled_graphs()
    with side_errors(name, result):
        if name not in TRL_SIDES:
            from benchmarks.ours import run_ours

            with tempfile.TemporaryDirectory(prefix="ppo-bench-heads-") as folder:
                run_ours(args.ablation(name), prompts, tokenizer, accelerator, probe, write_heads(heads, folder), result)
        else:
            from benchmarks.trl_ppo import run_trl

            run_trl(args, prompts, tokenizer, accelerator, probe, heads, result, compiled=name == "trl_compiled")
    result["compiled_graphs"] = compiled_graphs() - graphs  # what torch.compile compiled during this side
    # NVML's device-wide reading (CUDA context and paged optimizer states included) at phase ends.
    result["nvml_used_max_bytes"] = probe.nvml_max
    probe.nvml_max = None
    release_memory()
    result["at_end"] = probe.now()
    result["load_average_at_end"] = os.getloadavg()
    return result


ISOLATE_OWN = ("--sides", "--rounds", "--out_dir", "--isolate", "--side_run_out", "--stop_at")


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's own count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def round_orders(sides: list[str], rounds: int) -> list[list[str]]:
    """The order of the sides in each round: as given, then reversed, alternately (ABBA for two sides), so a
    machine whose speed drifts during the command slows the first and the last side of the run alike."""
    return [list(sides) if r % 2 == 0 else list(reversed(sides)) for r in range(rounds)]


def merge_round(side: Optional[dict], run: dict, round_: int) -> dict:
    """One side's record over its rounds: every round's steps (each marked with its round), the worst status,
    the highest peaks, each round's load averages; setup and start figures from its first round."""
    for step in run["steps"]:
        step["round"] = round_
    loads = {k: run.get(k) for k in ("at_start", "load_average_at_start", "load_average_at_end", "compiled_graphs")}
    if side is None:
        return {**run, "rounds": [{"round": round_, **loads}]}
    side["steps"] += run["steps"]
    side["rounds"].append({"round": round_, **loads})
    if side["status"] == "ok" and run["status"] != "ok":
        side.update(status=run["status"], error=f"round {round_}: {run['error']}")
    nvml = [v for v in (side.get("nvml_used_max_bytes"), run.get("nvml_used_max_bytes")) if v is not None]
    side["nvml_used_max_bytes"] = max(nvml) if nvml else None
    side["load_average_at_end"], side["at_end"] = run.get("load_average_at_end"), run.get("at_end")
    return side


def resolved(args: Workload, device: torch.device) -> dict[str, str]:
    """What the 'auto' settings became on this device (both sides load the same way)."""
    from trainer.engine.optim import resolve_optimizer_name
    from trainer.model.loading import pick_attention, resolve_precision

    four_bit, dtype = resolve_precision(args.model, device)
    return {"quantization": "nf4" if four_bit else "none", "dtype": str(dtype).removeprefix("torch."),
            "attn_implementation": pick_attention(args.attn_implementation, device),
            "optimizer": resolve_optimizer_name(args.optimizer, device, quiet=True)}


def default_out_dir(args: Workload, device: torch.device) -> Path:
    quant = f"-{args.quantization}" if args.quantization != "auto" else ""
    return ROOT / "benchmarks" / "results" / f"ppo_vs_trl-{args.model_name_or_path}{quant}-{device.type}"


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = Workload.parse(argv)
    log_to_stdout()
    quiet_libraries()
    if args.bench.export_tokenizer:
        export_tokenizer(args)
        return {}
    args.check()
    scratch = tempfile.mkdtemp(prefix="ppo-bench-")  # the Accelerator's project folder; nothing is logged there
    try:
        return run_benchmark(args, argv, make_bench_accelerator(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_benchmark(args: Workload, argv: list[str], accelerator) -> dict:
    from foundation.provenance import provenance, relative_command, relative_path

    sides = args.side_list
    device = accelerator.device
    probe = MemoryProbe(device)
    run = side_runner(args, argv, accelerator, probe)
    if args.bench.side_run_out:  # a child of --isolate: one side, once, its record to the parent
        record = run(sides[0])
        Path(args.bench.side_run_out).write_text(json.dumps(record, default=str))
        return record
    out_dir = Path(args.bench.out_dir) if args.bench.out_dir else default_out_dir(args, device)
    command = "python -m benchmarks.ppo_vs_trl " + relative_command(argv)
    report = {"kind": "ppo_vs_trl", "device_kind": "cuda" if device.type == "cuda" else "cpu",
              **provenance(device, command), "trl_version": library_versions(["trl"])["trl"],
              "mixed_precision": accelerator.mixed_precision,
              "settings": {k: relative_path(v) if isinstance(v, str) else v
                           for part in args.settings().values() for k, v in part.items()},
              "resolved": resolved(args, device),
              "trl_ppo_config": trl_batch_settings(args), "tokens_per_step": args.tokens(),
              "simulated_gpu_gib": args.simulate_gpu_gib if device.type == "cuda" else None,
              "device_total_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
              "sides": {}}
    report["rss_peak_resettable"] = probe.rss_resettable
    report["rounds"] = []
    for round_, order in enumerate(round_orders(sides, args.bench.rounds), start=1):
        report["rounds"].append({"round": round_, "order": order, "step_s": {}})
        for name in order:
            record = run(name)
            report["rounds"][-1]["step_s"][name] = summarize(record, args.tokens()).get("step_s")
            side = report["sides"][name] = merge_round(report["sides"].get(name), record, round_)
            side["summary"] = summarize(side, args.tokens())
            if "ours" in report["sides"] and "trl" in report["sides"]:
                report["ratios"] = ratios(report["sides"]["ours"]["summary"], report["sides"]["trl"]["summary"])
            write_report(report, out_dir)
    logger.info("wrote %s", out_dir / "ppo_vs_trl.md")
    if report["sides"] and all(side["status"] == CUT for side in report["sides"].values()):
        logger.error("every side ran out of the time given (--stop_at): no figure")
        raise SystemExit(EXIT_CUT)
    return report


def side_runner(args: Workload, argv: list[str], accelerator, probe: MemoryProbe) -> Callable[[str], dict]:
    """How one side is run: in a process of its own (`--isolate`: the parent loads nothing of the work),
    or in this one - a child of --isolate, or --isolate false - with the memory cap, TRL's import, the
    tokenizer, the prompts and the head weights set up once for every side."""
    if args.bench.isolate and not args.bench.side_run_out:
        return lambda name: side_in_own_process("benchmarks.ppo_vs_trl", name, SIDE_NAMES[name], argv, ISOLATE_OWN,
                                                ["--rounds", "1"], args.bench.stop_at)
    from accelerate.utils import set_seed

    from trainer.engine.setup import simulate_gpu_memory

    simulate_gpu_memory(args.simulate_gpu_gib, accelerator.device)
    if "trl" in args.side_list:
        try:  # before either side, so both start from the same libraries in memory
            import trl.experimental.ppo.ppo_trainer  # noqa: F401
        except ImportError as exc:  # the TRL side then records the error; ours still runs
            logger.warning("TRL cannot be imported (%s); pip install -e '.[bench]'", exc)
    set_seed(args.seed)
    tokenizer = load_bench_tokenizer(args)
    # One batch more than the steps: TRL's last step then does not end its DataLoader's epoch, where
    # accelerate would sync (and step the optimizer) after every micro-batch. Ours reads the first ones.
    prompts = fixed_length_prompts(args, tokenizer, (args.total_steps + 1) * args.rollout_batch_size)
    heads = head_weights(hidden_size(args, len(tokenizer)), args.model_seed)

    def run(name: str) -> dict:
        set_seed(args.seed)
        return run_side(name, args, prompts, tokenizer, accelerator, probe, heads)

    return run


def quiet_libraries() -> None:
    """Deprecation notices that TRL 1.12 triggers in transformers 5 on every step, and accelerate's
    gather notice TRL's metrics cause: nothing a reader of the benchmark acts on."""
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")
    warnings.filterwarnings("ignore", message=".*generation_config.*generation-related arguments.*")
    logging.getLogger("accelerate.accelerator").setLevel(logging.WARNING)


def write_report(report: dict, out_dir: Path) -> None:
    from benchmarks.report import render_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ppo_vs_trl.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "ppo_vs_trl.md").write_text(render_markdown(report))


if __name__ == "__main__":
    run(main)
