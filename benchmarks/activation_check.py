"""The estimator's activation and logit bytes held against the ones measured on the CPU, stage by stage.

    python -m benchmarks.activation_check [--variants tiny,smollm2-ckpt] [--out_dir DIR]

Each model variant runs sft, reward, dpo, ppo and grpo for one step in its own process with
`--profile_memory true`, on rows shaped exactly as the estimator assumes. Each phase's measured activations,
logits and transient peak (`profiling.live`) are set beside the estimate for the run's saved settings.
Writes activation_check.json and README.md into --out_dir; `--render` rewrites the README from the JSON.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from foundation.cli import UsageError, argument_parser, run
from foundation.files import write_atomic
from foundation.provenance import PROJECT_ROOT, provenance
from profiling import components as C
from profiling.predict import EstimateArguments, estimate, resolve_shape
from profiling.report import table_lines

MIB = C.MIB
SIGNIFICANT = 16 * MIB  # terms at least this large are held to TOLERANCE
TOLERANCE = 0.10
STAGES = ("sft", "reward", "dpo", "ppo", "grpo")
VARIANTS = {  # name -> (model flags, gradient checkpointing)
    "tiny": (["--model_name_or_path", "tiny-llama"], False),
    "tiny-ckpt": (["--model_name_or_path", "tiny-llama"], True),
    "smollm2": (["--model_name_or_path", "smollm2-135m"], False),
    "smollm2-ckpt": (["--model_name_or_path", "smollm2-135m"], True),
    "tiny-vocab128k": (["--model_name_or_path", "tiny-llama", "--preset_overrides", "vocab_size=128256"], False),
    # two layers as wide as a 1B model's, checkpointed, Llama-3's vocabulary: every term held, in seconds (the test's)
    "wide-vocab128k-ckpt": (["--model_name_or_path", "tiny-llama", "--preset_overrides",
                             "hidden_size=1024,intermediate_size=2816,vocab_size=128256"], True),
}
MAX_LENGTH, PROMPT_TOKENS = 96, 4  # sft / reward / dpo sequences; the prompt left of each completion
PROMPT_LENGTH, NEW_TOKENS = 24, 8  # ppo / grpo
COMMON = ["--quantization", "none", "--lora_r", "16", "--lora_alpha", "32", "--max_steps", "1",
          "--save_every", "0", "--eval_every", "0", "--eval_size", "0", "--report_to", "none",
          "--progress_bar", "false", "--warmup_steps", "0",
          "--min_prompt_tokens", str(PROMPT_TOKENS), "--max_length", str(MAX_LENGTH),
          "--max_prompt_length", str(PROMPT_LENGTH), "--sft_size", "16", "--reward_size", "16", "--ppo_size", "16"]
STAGE_FLAGS = {
    "sft": ["--micro_batch_size", "4", "--lora_dropout", "0.05"],
    "reward": ["--micro_batch_size", "2", "--lora_dropout", "0.05"],
    "dpo": ["--micro_batch_size", "2", "--lora_dropout", "0.05"],
    "ppo": ["--micro_batch_size", "2", "--rollout_batch_size", "4", "--rollout_micro_batch_size", "4",
            "--mini_batch_size", "4", "--ppo_epochs", "1", "--max_new_tokens", str(NEW_TOKENS),
            "--min_new_tokens", str(NEW_TOKENS), "--eval_prompts", "0"],
    "grpo": ["--micro_batch_size", "2", "--rollout_batch_size", "2", "--num_generations", "2",
             "--rollout_micro_batch_size", "4", "--mini_batch_size", "4", "--max_new_tokens", str(NEW_TOKENS),
             "--min_new_tokens", str(NEW_TOKENS), "--eval_prompts", "0"],
}
# What each phase's non-logit transient memory is in the estimate's components.
ACTIVATION_TERMS = (C.ACTIVATIONS, C.KV_CACHE, C.OPTIMIZER_TEMPORARIES)
# Why terms are off (the allocations alive at the measured peaks, read off the same allocator events);
# `cause_of` says which applies to a term.
CAUSES = {
    "fused_adamw": "the trainer's AdamW runs torch's fused kernel, which allocates no temporaries; the estimate "
    "(profiling/optimizers.py step_temporaries) assumes foreach AdamW's fp32 list of the moments' size",
}


def cause_of(row: dict, term: str) -> Optional[str]:
    """The CAUSES key that explains `row`'s `term` being off, if one was found."""
    return "fused_adamw" if row["phase"] == "optimizer_step" else None


def write_rows(path: Path, rows: int = 64) -> Path:
    """Preference rows of one shape: a long prompt (left-truncated to what the completion leaves) and
    completions of MAX_LENGTH - PROMPT_TOKENS tokens with their EOS (one token per repeated word)."""
    words = MAX_LENGTH - PROMPT_TOKENS - 1
    lines = [json.dumps({"prompt": f"question {i}:" + " tell" * 200, "chosen": " yes" * words,
                         "rejected": " no" * words}) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def stage_command(stage: str, variant: str, data: Path, out: Path, adapters: dict[str, Path]) -> list[str]:
    model, checkpointing = VARIANTS[variant]
    command = [sys.executable, f"trainer/{stage}.py", *model, *COMMON, *STAGE_FLAGS[stage], "--dataset", str(data),
               "--gradient_checkpointing", str(checkpointing).lower(), "--output_dir", str(out),
               "--profile_memory", "true"]
    if stage in ("dpo", "ppo", "grpo"):
        command += ["--sft_adapter", str(adapters["sft"])]
    if stage in ("ppo", "grpo"):
        command += ["--reward_adapter", str(adapters["reward"])]
    return command


def estimate_for(run_dir: Path, stage: str) -> dict:
    """The estimate of the run's own saved settings on the CPU (online RL turns LoRA dropout off)."""
    config = json.loads((run_dir / "config.json").read_text())
    sections = [SimpleNamespace(**config.get(k, {})) for k in ("plan", "model", "data", "train", "stage")]
    args = EstimateArguments.of_run(*sections, stage=stage, device="cpu")
    return estimate(resolve_shape(args), args)


def _term(measured: Optional[int], estimated: Optional[int]) -> dict:
    ratio = measured / estimated if measured is not None and estimated else None
    held = max(measured or 0, estimated or 0) >= SIGNIFICANT
    return {"measured": measured, "estimated": estimated, "ratio": ratio, "held": held,
            "within": None if not held else ratio is not None and abs(ratio - 1) <= TOLERANCE}


def compare(variant: str, stage: str, run_dir: Path) -> list[dict]:
    memory = json.loads((run_dir / "memory.json").read_text())
    predicted = {p["phase"]: p for p in estimate_for(run_dir, stage)["phases"]}
    rows = []
    for phase in memory["phases"]:
        live, guess = phase.get("live"), predicted.get(phase["phase"])
        if not live or guess is None:  # evaluation: not a phase the estimator sizes
            continue
        at_peak, own = guess["components"], guess["term_peaks"]  # the phase's peak moment; each term's own peak
        act = sum(own.get(c) or 0 for c in ACTIVATION_TERMS)
        transient = sum(at_peak.get(c) or 0 for c in (*ACTIVATION_TERMS, C.LOGITS))
        rows.append({"variant": variant, "stage": stage, "phase": phase["phase"], "calls": phase["calls"],
                     "activations": _term(live["others_peak"], act),
                     "logits": _term(live["logits_peak"], own.get(C.LOGITS) or 0),
                     "transient": _term(live["peak"], transient),
                     "logits_at_peak": live["logits_at_peak"], "saved_for_backward": phase.get("saved_for_backward")})
    return rows


def run_variant(variant: str, work: Path, data: Path, timeout_s: int,
                stages: tuple[str, ...] = STAGES) -> tuple[list[dict], list[dict]]:
    """The `stages` of one variant, in STAGES' order (each needs the adapters of those before it): (comparison
    rows, one record per run)."""
    rows, runs, adapters = [], [], {}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for stage in stages:
        out = work / variant / stage
        command = stage_command(stage, variant, data, out, adapters)
        started = time.perf_counter()
        proc = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        record = {"variant": variant, "stage": stage, "wall_s": round(time.perf_counter() - started, 1),
                  "exit_code": proc.returncode,
                  "command": shlex.join([Path(command[0]).name, *command[1:]]).replace(str(work), "WORK")}
        runs.append(record)
        print(f"{variant} {stage}: exit {proc.returncode} in {record['wall_s']} s", flush=True)
        if proc.returncode != 0:
            record["error"] = proc.stderr.strip().splitlines()[-3:]
            continue
        adapters[stage] = out / "adapter"
        rows += compare(variant, stage, out)
    return rows, runs


OVERHEAD_MODES = {"recorder off": {"enabled": False}, "tensor walks only": {"cpu_timeline": False},
                  "walks + allocator timeline": {}}


def measure_overhead(repeats: int = 5) -> list[dict]:
    """CPU seconds of a tiny-preset SFT step (4 x 96 tokens, forward, backward, AdamW) and of sampling 8 tokens
    for 4 prompts, in phases of a MemoryRecorder off, counting tensors only, and with the allocator timeline:
    the median of `repeats` runs each, the modes interleaved, on one thread (process CPU time is what a
    shared machine's other work disturbs least)."""
    import statistics

    import torch

    from foundation.settings import ModelArguments
    from profiling.recorder import MemoryRecorder
    from trainer.model.decode import Generator, Sampling
    from trainer.model.shared_base import AdapterSpec, build_shared_model
    from trainer.rl.rollout import sample_responses

    torch.manual_seed(0)
    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", lora_r=16, lora_alpha=32)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=49152)
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4)
    ids = torch.randint(0, 49152, (4, MAX_LENGTH), generator=torch.Generator().manual_seed(0))
    sampling = Sampling(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)

    def train(recorder):
        model.train()
        with recorder.phase("forward_backward"):
            model(ids, torch.ones_like(ids), adapter="policy", output="logprobs", labels=ids).sum().backward()
            recorder.sample()
        with recorder.phase("optimizer_step"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def generate(recorder):
        model.eval()
        prompts = ids[:, :PROMPT_LENGTH]
        with recorder.phase("generate"):
            sample_responses(Generator(model), prompts, torch.ones_like(prompts), sampling, eos_id=0, pad_id=0,
                             with_logprobs=True)

    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    for work, body in (("sft step", train), ("sample 8 tokens", generate)):
        body(MemoryRecorder("sft", model=model, optimizer=optimizer, enabled=False))  # warm-up
        seconds: dict[str, list[float]] = {mode: [] for mode in OVERHEAD_MODES}
        for _ in range(repeats):
            for mode, options in OVERHEAD_MODES.items():
                recorder = MemoryRecorder("sft", model=model, optimizer=optimizer, **options)
                started = time.process_time()
                body(recorder)
                seconds[mode].append(time.process_time() - started)
        base = statistics.median(seconds["recorder off"])
        rows += [{"work": work, "mode": mode, "median_s": statistics.median(s),
                  "ratio": statistics.median(s) / base} for mode, s in seconds.items()]
    torch.set_num_threads(threads)
    return rows


def _off_group(phase: str, term: str, items: list[tuple[dict, str]]) -> str:
    """'phase term (n): variants / stages, ratio lo-hi' for terms off alike."""
    variants = sorted({r["variant"] for r, _ in items}, key=list(VARIANTS).index)
    stages = sorted({r["stage"] for r, _ in items}, key=STAGES.index)
    ratios = [r[t]["ratio"] or 0 for r, t in items]
    spread = f"{min(ratios):.2f}" if min(ratios) == max(ratios) else f"{min(ratios):.2f}-{max(ratios):.2f}"
    return f"{phase} {term} ({len(items)}: {', '.join(variants)}; {', '.join(stages)}; ratio {spread})"


def _term_name(phase: str, term: str) -> str:
    """What a row's "activations" term is in that phase."""
    if term != "activations":
        return term
    return {"generate": "kv_cache + activations", "optimizer_step": "optimizer_temporaries"}.get(phase, term)


def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _cell(term: dict) -> str:
    ratio = "-" if term["ratio"] is None else f"{term['ratio']:.2f}"
    flag = "" if term["within"] is None else (" ok" if term["within"] else " **off**")
    return f"{_mib(term['measured'])} / {_mib(term['estimated'])} ({ratio}{flag})"


def markdown(result: dict) -> str:
    prov = result["provenance"]
    held = [(r, t) for r in result["rows"] for t in ("activations", "logits", "transient") if r[t]["held"]]
    within = sum(1 for r, t in held if r[t]["within"])
    lines = ["# Activation and logit memory: estimated against measured on the CPU", "",
             f"- command: `{prov['command']}`", f"- date: {prov['date']}; git revision `{prov['git_revision']}`",
             f"- device: {prov['device_name']}; torch {prov['versions'].get('torch')}, transformers "
             f"{prov['versions'].get('transformers')}, peft {prov['versions'].get('peft')}",
             f"- shapes: sft/reward/dpo sequences of exactly {MAX_LENGTH} tokens (prompt {PROMPT_TOKENS}), sft "
             f"micro-batch 4, reward/dpo 2 pairs; ppo/grpo prompts of {PROMPT_LENGTH} tokens, {NEW_TOKENS} new "
             "tokens, rollouts of 4 rows, update micro-batch 2; fp32, LoRA r 16 on every linear layer; one step",
             "- measured: the CPU allocator's events inside each phase (`profiling/live.py`): the largest sum of "
             "bytes allocated in the phase and alive at once, tensor-walked ones (gradients, optimizer states) left "
             "out; logits = tensors an operator read with the vocabulary as last dimension",
             "- estimated: `profiling.predict` on each run's saved settings; activations include the KV cache "
             "(generate) and the optimizer's temporaries (optimizer_step)",
             f"- cells: measured / estimated MiB (ratio); terms of at least {SIGNIFICANT // MIB} MiB are held to "
             f"within {TOLERANCE:.0%}: **{within} of {len(held)}** are", ""]
    terms = {term: [(r, t) for r, t in held if _term_name(r["phase"], t) == term]
             for term in ("activations", "kv_cache + activations", "optimizer_temporaries", "logits", "transient")}
    lines += table_lines(["term", "held (at least 16 MiB)", "within 10%"], "lrr",
                         [[term, len(mine), sum(1 for r, t in mine if r[t]["within"])] for term, mine in terms.items()])
    lines += ["", *table_lines(["variant", "stage", "phase", "activations", "logits", "transient (both at once)"],
                               "lllrrr", [[r["variant"], r["stage"], r["phase"], *(_cell(r[t]) for t in
                                           ("activations", "logits", "transient"))] for r in result["rows"]])]
    off = [(r, t) for r, t in held if not r[t]["within"]]
    if off:
        lines += ["", "## Terms off by more than the tolerance, by cause", ""]
        for cause in [*CAUSES, None]:
            groups: dict[tuple[str, str], list[tuple[dict, str]]] = {}
            for r, t in off:
                if cause_of(r, t) == cause:
                    groups.setdefault((r["phase"], t), []).append((r, t))
            if groups:
                lines.append(f"- {CAUSES[cause] if cause else 'cause not named'}: " + "; ".join(
                    _off_group(phase, term, items) for (phase, term), items in groups.items()))
    if result.get("overhead"):
        lines += ["", f"## Overhead of the measurement (tiny preset, one process on one thread, median of "
                  f"{result['overhead_repeats']})", "", *table_lines(
                      ["work", "recorder", "CPU s", "x recorder off"], "llrr",
                      [[r["work"], r["mode"], f"{r['median_s']:.3f}", f"{r['ratio']:.2f}"] for r in result["overhead"]])]
    failed = [r for r in result["runs"] if r["exit_code"]]
    if failed:
        lines += ["", "## Runs that failed", ""] + [f"- {r['variant']} {r['stage']}: {r.get('error')}" for r in failed]
    lines += ["", "## Runs", "", *table_lines(["variant", "stage", "s", "command"], "llrl", [
        [r["variant"], r["stage"], r["wall_s"], f"`{r['command']}`"] for r in result["runs"]])]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argument_parser("python -m benchmarks.activation_check", __doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma list of {', '.join(VARIANTS)}.")
    parser.add_argument("--out_dir", type=Path, default=PROJECT_ROOT / "benchmarks/results/activation_check-cpu")
    parser.add_argument("--work_dir", type=Path, default=None, help="Run folders (default: a temporary folder).")
    parser.add_argument("--timeout_s", type=int, default=900, help="Limit per stage run.")
    parser.add_argument("--overhead_repeats", type=int, default=5,
                        help="Runs per mode of the overhead check (0: none).")
    parser.add_argument("--render", action="store_true",
                        help="Only rewrite README.md from the activation_check.json in --out_dir.")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads((args.out_dir / "activation_check.json").read_text())
        write_atomic(args.out_dir / "README.md", markdown(result))
        return result
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="activation_check-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = write_rows(work / "rows.jsonl")
        rows, runs = [], []
        for variant in variants:
            more_rows, more_runs = run_variant(variant, work, data, args.timeout_s)
            rows, runs = rows + more_rows, runs + more_runs
    overhead = measure_overhead(args.overhead_repeats) if args.overhead_repeats else []
    command = shlex.join(["python", "-m", "benchmarks.activation_check", *argv])
    result = {"provenance": provenance(command=command), "significant_bytes": SIGNIFICANT, "tolerance": TOLERANCE,
              "rows": rows, "runs": runs, "overhead": overhead, "overhead_repeats": args.overhead_repeats}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out_dir / "activation_check.json", json.dumps(result, indent=2) + "\n")
    write_atomic(args.out_dir / "README.md", markdown(result))
    print(f"wrote {args.out_dir / 'README.md'}")
    return result


if __name__ == "__main__":
    run(main)
