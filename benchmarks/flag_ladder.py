"""Benchmark the optimization flags against each other: the torchtune-style memory ladder.

    python -m benchmarks.flag_ladder --stage sft --model_name_or_path llama-2-7b --simulate_gpu_gib 24
    python -m benchmarks.flag_ladder --stage ppo --grid "quantization=nf4,none;gradient_checkpointing=true,false"

Each variant runs the real stage script for a few steps in its own process (clean allocator statistics; an
OOM ends only that variant) with `--profile_memory true`; the table (peak memory, median step time,
tokens/s) is read from the run's files. Writes bench.json, bench.md and bench.png.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from foundation.cli import Checked, UsageError, above, at_least, one_of, parse, parse_assignments, run
from foundation.files import write_atomic
from foundation.stages import STAGES
from profiling.components import GIB, gib
from profiling.report import table_lines

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BenchArguments(Checked):
    stage: str = field(default="sft", metadata={"help": "sft, reward, dpo or ppo."})
    model_name_or_path: str = field(default="smollm2-135m", metadata={"help": "Model for every variant."})
    config: Optional[str] = field(default=None, metadata={"help": "Stage YAML (default trainer/configs/STAGE.yaml)."})
    grid: str = field(default="", metadata={"help": "'key=a,b;key2=c,d': every combination, instead of the ladder."})
    steps: int = field(default=3, metadata={"help": "Optimizer steps per variant (the first is warm-up)."})
    extra: str = field(default="", metadata={"help": "'key=value,...' overrides for every variant."})
    with_deepspeed: bool = field(default=True, metadata={"help": "Add the DeepSpeed ZeRO-2 CPU-offload alternative."})
    simulate_gpu_gib: float = field(default=0.0, metadata={"help": "Cap CUDA memory per variant (24: an RTX 4090)."})
    budget_gib: float = field(default=24.0, metadata={"help": "Budget line of the chart."})
    out_dir: Optional[str] = field(default=None, metadata={"help": "Default benchmarks/results/flags-STAGE-MODEL."})
    timeout_s: int = field(default=3600, metadata={"help": "Limit per variant."})

    RULES = {"stage": one_of(*STAGES), "steps": at_least(1), "simulate_gpu_gib": at_least(0),
             "budget_gib": above(0), "timeout_s": at_least(1)}


@dataclass
class Variant:
    name: str
    overrides: dict[str, str]
    launch_config: str = "accelerate_configs/single_gpu.yaml"
    skip_reason: Optional[str] = None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def ladder() -> list[Variant]:
    """Baseline, then one optimization more per rung (each keeps the ones before it)."""
    gpu = cuda_available()
    base = {"quantization": "none", "gradient_checkpointing": "false", "attn_implementation": "eager",
            "optimizer": "adamw_torch", "dtype": "bfloat16" if gpu else "float32"}
    rungs = [("baseline (full-precision base, eager, AdamW)", {}),
             ("+ SDPA attention", {"attn_implementation": "sdpa"}),
             ("+ flash_attention_2", {"attn_implementation": "flash_attention_2"}),
             ("+ gradient checkpointing", {"gradient_checkpointing": "true"}),
             ("+ 4-bit NF4 base", {"quantization": "nf4"}),
             ("+ paged 8-bit AdamW", {"optimizer": "paged_adamw_8bit"})]
    out, current = [], dict(base)
    for name, change in rungs:
        current = {**current, **change}
        skip = None
        if change.get("attn_implementation") == "flash_attention_2":
            if not gpu or importlib.util.find_spec("flash_attn") is None:
                skip = "flash-attn is not installed" if gpu else "needs CUDA"
                current["attn_implementation"] = "sdpa"  # later rungs build on what really ran
        out.append(Variant(name, dict(current), skip_reason=skip))
    return out


def grid(spec: str) -> list[Variant]:
    axes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        key, sep, values = part.partition("=")
        if not sep:
            raise UsageError(f"--grid: '{part}' is not key=v1,v2")
        axes.append([(key.strip(), v.strip()) for v in values.split(",") if v.strip()])
    return [Variant(", ".join(f"{k}={v}" for k, v in combo), dict(combo)) for combo in itertools.product(*axes)]


def deepspeed_variant(previous: Variant) -> Variant:
    overrides = {**previous.overrides, "optimizer": "auto"}
    return Variant("alternative: DeepSpeed ZeRO-2 CPU optimizer offload (instead of paged 8-bit AdamW)", overrides,
                   launch_config="accelerate_configs/deepspeed_zero2_offload.yaml",
                   skip_reason=None if cuda_available() else "DeepSpeed offload is benchmarked on GPUs")


def command(args: BenchArguments, variant: Variant, run_dir: Path) -> list[str]:
    import os

    config = args.config or f"trainer/configs/{args.stage}.yaml"
    # On the CPU (one process, accelerate_configs/cpu.yaml) the launcher would only start the script: it runs alone.
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file", variant.launch_config]
              if cuda_available() else [sys.executable])
    # Paths relative to the project root (the variants run there): the recorded commands name no machine's folders.
    cmd = [*launch, f"trainer/{args.stage}.py", "--config", config, "--output_dir", os.path.relpath(run_dir, ROOT),
           "--model_name_or_path", args.model_name_or_path, "--max_steps", str(args.steps),
           "--profile_memory", "true", "--report_to", "none", "--save_every", "0", "--eval_every", "0",
           "--eval_batches", "1", "--progress_bar", "false", "--warmup_steps", "0",
           "--simulate_gpu_gib", str(args.simulate_gpu_gib), "--check_budget", "false"]
    if args.stage in ("reward", "dpo"):
        cmd += ["--sft_adapter", "null"]
    if args.stage == "ppo":
        cmd += ["--sft_adapter", "null", "--reward_adapter", "null", "--scripted_reward", "length:16",
                "--eval_prompts", "0"]
    for key, value in parse_assignments(args.extra, "extra").items():
        cmd += [f"--{key}", value]
    for key, value in variant.overrides.items():
        cmd += [f"--{key}", value]
    return cmd


def read_result(run_dir: Path, stage: str) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in rows if "perf/step_s" in r or "perf/update_s" in r]
    timed = steps[1:] or steps  # the first step pays for warm-up and lazy initialisation
    if stage == "ppo":
        step_s = [r["perf/rollout_s"] + r["perf/update_s"] for r in timed]
        tokens = [r["perf/update_tokens_per_s"] for r in timed]
        extra = {"generate_tokens_per_s": statistics.median(r["perf/generate_tokens_per_s"] for r in timed)}
    else:
        step_s = [r["perf/step_s"] for r in timed]
        tokens = [r["perf/tokens_per_s"] for r in timed]
        extra = {}
    memory = json.loads((run_dir / "memory.json").read_text())
    cuda = [p["cuda"] for p in memory["phases"] if p.get("cuda")]
    result = {"step_s": statistics.median(step_s), "tokens_per_s": statistics.median(tokens), **extra,
              "peak_allocated_bytes": max((c["peak_allocated"] for c in cuda), default=None),
              "peak_reserved_bytes": max((c["peak_reserved"] for c in cuda), default=None),
              "nvml_used_bytes": max((c["nvml_used"] or 0 for c in cuda), default=None) or None}
    rss = [r.get("perf/peak_rss_gb") for r in steps if r.get("perf/peak_rss_gb") is not None]
    result["peak_rss_bytes"] = int(max(rss) * 1e9) if rss else None
    return result


def run_variant(args: BenchArguments, variant: Variant, out_dir: Path, index: int) -> dict:
    row = {"name": variant.name, "overrides": variant.overrides, "launch_config": variant.launch_config}
    if variant.skip_reason:
        return {**row, "status": "skipped", "reason": variant.skip_reason}
    run_dir = out_dir / "runs" / f"{index:02d}"
    cmd = command(args, variant, run_dir)
    from foundation.provenance import relative_command

    row["command"] = relative_command(cmd)
    print(f"[bench] {variant.name}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {**row, "status": "timeout"}
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        status = "out of memory" if "out of memory" in text.lower() else "failed"
        return {**row, "status": status, "tail": text[-1500:]}
    return {**row, "status": "ok", **read_result(run_dir, args.stage)}


def markdown(data: dict) -> str:
    lines = [f"# Flag benchmark: {data['stage']} on {data['model']}", "",
             f"- device: {data['device_name']}; date {data['date']}; git `{data['git_revision']}`",
             f"- command: `{data['command']}`",
             f"- {data['steps']} optimizer steps per variant, medians over steps 2+; CUDA cap "
             f"{data['simulate_gpu_gib'] or 'none'} GiB", "",
             *table_lines(["variant", "status", "peak allocated (GiB)", "peak reserved (GiB)", "peak RSS (GiB)",
                           "step (s)", "tokens/s"], "ll" + "r" * 5, [
                 [r["name"], "ok", gib(r["peak_allocated_bytes"], 2), gib(r["peak_reserved_bytes"], 2),
                  gib(r["peak_rss_bytes"], 2), f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}"] if r["status"] == "ok"
                 else [r["name"], r["status"] + (": " + r["reason"] if r.get("reason") else ""), *[None] * 5]
                 for r in data["rows"]])]
    return "\n".join(lines) + "\n"


def chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["status"] == "ok"]
    if not rows:
        return
    on_gpu = rows[0]["peak_allocated_bytes"] is not None
    memory = [(r["peak_allocated_bytes"] if on_gpu else r["peak_rss_bytes"] or 0) / GIB for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 2))
    names = [r["name"] for r in rows]
    ax1.barh(names, memory, color="#4c72b0")
    if on_gpu:
        ax1.axvline(data["budget_gib"], color="red", linestyle="--", label=f"budget {data['budget_gib']} GiB")
        ax1.legend()
    ax1.set_xlabel("peak allocated (GiB)" if on_gpu else "peak resident set, CPU (GiB)")
    ax1.invert_yaxis()
    ax2.barh(names, [r["tokens_per_s"] for r in rows], color="#55a868")
    ax2.set_xlabel("training tokens / s")
    ax2.set_yticklabels([])
    ax2.invert_yaxis()
    fig.suptitle(f"{data['stage']} on {data['model']} ({data['device_name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> dict:
    from foundation.provenance import provenance, relative_command

    argv = list(sys.argv[1:] if argv is None else argv)
    (args,) = parse([BenchArguments], argv)
    parse_assignments(args.extra, "extra")  # a malformed --extra stops here, before the first variant
    variants = grid(args.grid) if args.grid else ladder()
    if args.with_deepspeed and not args.grid:
        variants.append(deepspeed_variant(variants[-2]))
    out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / f"flags-{args.stage}-{args.model_name_or_path}")
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.device("cuda") if cuda_available() else torch.device("cpu")
    data = {**provenance(device, command="python -m benchmarks.flag_ladder " + relative_command(argv)),
            "stage": args.stage, "model": args.model_name_or_path, "steps": args.steps,
            "simulate_gpu_gib": args.simulate_gpu_gib, "budget_gib": args.budget_gib, "arguments": asdict(args),
            "rows": []}
    for i, variant in enumerate(variants):  # the files are rewritten after each rung: a run cut short keeps them
        data["rows"].append(run_variant(args, variant, out_dir, i))
        write_atomic(out_dir / "bench.json", json.dumps(data, indent=2) + "\n")
        write_atomic(out_dir / "bench.md", markdown(data))
    chart(data, out_dir / "bench.png")
    print(markdown(data))
    return data


if __name__ == "__main__":
    run(main)
