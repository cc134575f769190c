"""How long each call of the GPU kit takes: measured where a manifest says so, predicted where none does.

    python -m benchmarks.gpu.plan [--write]    # print the plan table [and rewrite it in the kit's README]

A step's GPU seconds are predicted from the estimator's shapes (decode against the bandwidth bound, other
passes against the bf16 peak, named guesses for process starts and builds) until a collected GPU
manifest measures them; smoke seconds come from the smoke runs kept as test fixtures (tests/fixtures/kit/).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from foundation.cli import argument_parser, run
from foundation.files import write_atomic
from profiling.report import table_lines

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SMOKE = ROOT / "tests" / "fixtures" / "kit"  # smoke runs of the kit on the CPU: fixtures, not results
README = ROOT / "benchmarks" / "gpu" / "README.md"
START, END = "<!-- gpu-plan:start -->", "<!-- gpu-plan:end -->"
CALL_LIMIT_S = 480  # one call of at most 8 minutes, wheels and packing included

# The card the plan is for (H100 SXM: the slower memory of the two machines lent).
BANDWIDTH = 3.35e12  # bytes/s
BF16_FLOPS = 989e12  # dense
# Guesses until a GPU manifest replaces them.
START_S = 20  # a Python process: torch, transformers, peft, bitsandbytes imports and the CUDA context
BUILD_S = 30  # the 7B architecture built with random weights and packed to NF4 one layer at a time
DECODE_FRACTION = 0.05  # NF4 decoding at batch 16, of the bound: dequantised per matmul, a kernel per layer part
MFU = 0.2  # training and scoring FLOPs, of the bf16 peak (NF4 dequantised per matmul, LoRA, checkpointing)
WHEELS_S, PACK_S = 45, 10  # run.sh's wheel install before the part, its archive after
GPU_TESTS_S = 40  # the first call's subset of tests/test_gpu.py: small models, a few seconds each
COMPILE_S = 86  # torch.compile of a 7B decode step or decoder layer, the first call (speed-*/decode: first call s)


@dataclass
class Work:
    """One model's share of a step: a PPO-style step's rows and lengths (rows=0: no rollout)."""

    rows: int = 0
    prompt: int = 0
    new: int = 0
    epochs: int = 0
    scoring_adapters: int = 0  # adapters scored over the rollout (policy, reference, value, reward)
    train_tokens: int = 0  # tokens of a supervised step (SFT, reward)


def seven_b():
    from profiling.shapes import load_shape

    return load_shape("llama-2-7b")


def decode_step_bytes(shape) -> int:
    """Bytes one decode step reads: packed weights, constants, norms and LM head (not the embedding table)."""
    from profiling.shapes import base_bytes, lora_tensor_sizes

    base = base_bytes(shape, "nf4", 2)
    embedding = shape.vocab_size * shape.hidden_size * 2
    adapter = 4 * sum(lora_tensor_sizes(shape, 16, "all-linear"))
    return base["base_weights"] + base["base_quant_constants"] + base["base_other"] - embedding + adapter


def step_seconds(work: Work, shape) -> float:
    """One step of `work` on the card: decode at the bound's fraction, every other pass at MFU."""
    params = shape.total_params()
    flops = 6 * params * work.train_tokens  # forward, backward, recomputation under checkpointing
    seconds = 0.0
    if work.rows:
        seconds += work.new * decode_step_bytes(shape) / (BANDWIDTH * DECODE_FRACTION)
        context = work.rows * (work.prompt + work.new)
        flops += 2 * params * work.rows * work.prompt  # prefill
        flops += 2 * params * context * work.scoring_adapters  # scoring
        flops += 6 * params * context * work.epochs  # the update
    return seconds + flops / (BF16_FLOPS * MFU)


def predicted(part: str) -> dict[str, float]:
    """Each step of `part` (the parts with a plan) in GPU seconds, before any call has timed it."""
    shape = seven_b()
    seed_ppo = Work(rows=16, prompt=256, new=128, epochs=4, scoring_adapters=4)
    bench_ppo = Work(rows=16, prompt=256, new=128, epochs=2, scoring_adapters=4)
    sft_step = Work(train_tokens=4 * 4 * 512)  # micro-batch 4 x 4 accumulation x 512 tokens
    reward_step = Work(train_tokens=2 * 4 * 4 * 512)  # pairs: two sequences each
    process = START_S + BUILD_S
    rl = process + COMPILE_S  # a PPO or GRPO process on CUDA compiles its decode step (--decode auto)
    if part == "first":
        return {"gpu-tests": START_S + GPU_TESTS_S,
                "sft+reward": START_S + 2 * BUILD_S + step_seconds(sft_step, shape) + step_seconds(reward_step, shape),
                "ppo": rl + 2 * step_seconds(seed_ppo, shape), "vs-estimate": START_S,
                # TRL's side builds policy, value and reward models: three 7B builds; its step taken as ours
                "ppo_vs_trl": 2 * START_S + 4 * BUILD_S + COMPILE_S + 4 * step_seconds(bench_ppo, shape)}
    if part == "memory":
        return {"sft": process + 3 * step_seconds(sft_step, shape), "reward": process + 3 * step_seconds(reward_step, shape),
                "ppo": rl + 3 * step_seconds(seed_ppo, shape),
                "grpo": rl + 2 * step_seconds(Work(rows=16, prompt=256, new=128, epochs=1, scoring_adapters=3), shape),
                "vs-estimate": START_S}
    if part == "speed":  # TRL's GRPO recipe (3 steps) and PPO vs TRL, ours compiling its decode step (and its
        # layers for the update); decode compiled from the dense copy at 16 and 1 rows, and last at the GRPO
        # recipe's shape (each row timed twice and warmed up, prefill apart, and compiled anew)
        from profiling.shapes import load_shape

        qwen = load_shape("qwen2.5-7b")

        def decode(model, rows: int, prompt: int, new: int) -> float:
            per_token = decode_step_bytes(model) / (BANDWIDTH * DECODE_FRACTION)
            return 3 * new * per_token + 3 * step_seconds(Work(rows=rows, prompt=prompt), model) + COMPILE_S

        grpo = Work(rows=8, prompt=256, new=256, epochs=1, scoring_adapters=0)
        return {"grpo": process + COMPILE_S + 3 * step_seconds(grpo, qwen),
                "vs-estimate": START_S,
                "decode": process + decode(shape, 16, 128, 64) + decode(shape, 1, 128, 64),
                "ppo_vs_trl": 2 * START_S + 4 * BUILD_S + COMPILE_S + 4 * step_seconds(bench_ppo, shape),
                "decode-grpo": process + decode(qwen, 8, 256, 256)}
    if part == "grpo_vs_trl":  # TRL's recipe on three sides (each its own build, a warm-up and a step), then the
        # seed PPO recipe's SFT and reward steps and 2 PPO steps under a 12 GB cap
        from profiling.shapes import load_shape

        grpo = 2 * step_seconds(Work(rows=8, prompt=256, new=256, epochs=1, scoring_adapters=0), load_shape("qwen2.5-7b"))
        return {"grpo_vs_trl": 3 * (process + grpo) + 2 * COMPILE_S,  # ours twice, each compiling its decode step
                "sft+reward": START_S + 2 * BUILD_S + step_seconds(sft_step, shape) + step_seconds(reward_step, shape),
                "ppo-12gb": rl + 2 * step_seconds(seed_ppo, shape), "vs-estimate-12gb": START_S}
    if part == "grpo_recipe":  # TRL's recipe on Qwen2.5-7B shapes: 8 completions of 256 tokens, r=32
        from profiling.shapes import load_shape

        qwen = load_shape("qwen2.5-7b")
        grpo = process + 2 * step_seconds(Work(rows=8, prompt=256, new=256, epochs=1, scoring_adapters=0), qwen)
        # under 8 GB the planner offloads the embedding, so it decodes eagerly (nothing to compile), a row per
        # update micro-batch: the update's work in eight passes instead of one, costed as one
        return {"grpo": grpo + COMPILE_S, "vs-estimate": START_S, "grpo-8gb": grpo, "vs-estimate-8gb": START_S}
    if part == "stages":  # 3 steps and a warm-up of 4 x 2 rows at 512 tokens, each side its own build
        tokens = 4 * 2 * 512
        work = {"sft": Work(train_tokens=tokens), "reward": Work(train_tokens=2 * tokens),
                "dpo": Work(train_tokens=2 * tokens + 2 * tokens // 3)}  # the reference's forward: a third more
        return {f"stages_vs_trl-{name}": 2 * process + 2 * 4 * step_seconds(w, shape) for name, w in work.items()}
    if part == "ladder":  # 7 rungs of 3 SFT steps, each its own process
        return {"ladder": 7 * (process + 3 * step_seconds(sft_step, shape))}
    if part == "check":
        return {"nvidia-smi": 1, "gpu-tests": START_S + 2 * GPU_TESTS_S}
    return {}


def manifests(kind: str) -> dict[str, dict]:
    """part -> the manifest summary (provenance.json) of its latest collected run, smoke or GPU."""
    found = {}
    for info in sorted((SMOKE if kind == "smoke" else RESULTS).glob("*/provenance.json")):
        data = json.loads(info.read_text())
        if data.get("part") and bool(data.get("smoke")) == (kind == "smoke") and (kind == "smoke" or data.get("device") == "cuda"):
            found[data["part"]] = data
    return found


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


def _step_seconds(step: Optional[dict]) -> str:
    """A step's measured seconds; a step the call's budget cut shows `cut after N` (or `cut` if never started)."""
    if not step:
        return "-"
    if step.get("status") == "cut":
        return f"cut after {step['seconds']:.0f}" if step.get("seconds") else "cut"
    return _seconds(step.get("seconds"))


def plan_table() -> str:
    from benchmarks.gpu.parts import BUDGET_S, PARTS

    smoke, gpu = manifests("smoke"), manifests("gpu")
    lines = [START, "", "_Generated by `python -m benchmarks.gpu.plan --write` from the manifests under "
             "`benchmarks/results/` (smoke: `tests/fixtures/kit/`) and the prediction in `benchmarks/gpu/plan.py`; "
             "do not edit by hand._", "",
             f"Predicted for an H100 from the estimator's shapes: decoding at {DECODE_FRACTION:.0%} of the bandwidth "
             f"bound, other passes at {MFU:.0%} of the bf16 peak, {START_S} s per process start and {BUILD_S} s per "
             f"7B NF4 build (guesses until a GPU manifest replaces them). Each call adds ~{WHEELS_S} s of wheel "
             f"install and ~{PACK_S} s of packing; the machine's start (1-3 minutes) comes before it.", ""]
    rows = []
    for part in ("first", "memory", "grpo_recipe", "speed", "grpo_vs_trl", "stages", "ladder", "check"):
        guess = predicted(part)
        smoke_steps = (smoke.get(part) or {}).get("steps") or {}
        gpu_steps = (gpu.get(part) or {}).get("steps") or {}
        names = list(guess) or list(smoke_steps) or list(gpu_steps)
        rows += [[f"`{part}`", name, _step_seconds(smoke_steps.get(name)), _seconds(guess.get(name)),
                  _step_seconds(gpu_steps.get(name))] for name in names]
        total = sum(guess.values()) if guess else None
        call = None if total is None else min(total, BUDGET_S[part]) + WHEELS_S + PACK_S
        measured = (gpu.get(part) or {}).get("seconds")
        rows.append([f"`{part}`", f"**the call** (steps within {BUDGET_S[part]} s, wheels, packing)",
                     _seconds((smoke.get(part) or {}).get("seconds")), _seconds(call), _seconds(measured)])
    lines += [*table_lines(["call", "step", "smoke s (CPU)", "GPU s predicted", "GPU s measured"], "llrrr", rows),
              "", END]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> str:
    parser = argument_parser("python -m benchmarks.gpu.plan", __doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="Rewrite the table in benchmarks/gpu/README.md.")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    table = plan_table()
    print(table)
    if args.write:
        text = args.readme.read_text()
        pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
        write_atomic(args.readme, pattern.sub(lambda _: table, text) if pattern.search(text) else text + "\n" + table + "\n")
    return table


if __name__ == "__main__":
    run(main)
