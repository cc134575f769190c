"""What to change when an estimate does not fit: each candidate re-estimated, in a fixed order.

The order is the usual cost order: settings that do not change the result first (micro-batch with
gradient accumulation, checkpointing, the 8-bit optimizer), then ones that change what is trained
(sequence lengths, rollout size, quantization, LoRA rank), then moving states off the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from foundation.cli import unplanned
from foundation.settings import ONLINE_RL_STAGES
from profiling import components as C
from profiling.predict import estimate
from profiling.shapes import ModelShape


def _halve(value: int) -> int:
    return max(1, value // 2)


def candidates(args) -> list[tuple[str, object]]:
    """(description, changed arguments) in the order they are suggested; only real changes. A setting left auto
    is changed from its value where nothing plans it (`foundation.cli.unplanned`)."""
    out, args = [], unplanned(args)
    if args.micro_batch_size > 1:
        mb = _halve(args.micro_batch_size)
        out.append((f"micro_batch_size {args.micro_batch_size} -> {mb} (raise gradient_accumulation_steps to keep the batch)",
                    replace(args, micro_batch_size=mb)))
    if not args.gradient_checkpointing:
        out.append(("gradient checkpointing on", replace(args, gradient_checkpointing=True)))
    if args.optimizer == "adamw_torch":
        out.append(("optimizer adamw_torch -> paged_adamw_8bit", replace(args, optimizer="paged_adamw_8bit")))
    if args.stage in ONLINE_RL_STAGES:
        rows = args.rollout_micro_batch_size or args.micro_batch_size
        if rows > 1:
            out.append((f"rollout_micro_batch_size {rows} -> {_halve(rows)} (generate and score fewer rows at once)",
                        replace(args, rollout_micro_batch_size=_halve(rows))))
        if args.max_new_tokens > 16:
            new = _halve(args.max_new_tokens)
            at_least = min(args.min_new_tokens, new)  # never above the new maximum
            lowered = f", min_new_tokens {args.min_new_tokens} -> {at_least}" if at_least != args.min_new_tokens else ""
            out.append((f"max_new_tokens {args.max_new_tokens} -> {new}{lowered}",
                        replace(args, max_new_tokens=new, min_new_tokens=at_least)))
        if args.max_prompt_length > 16:
            out.append((f"max_prompt_length {args.max_prompt_length} -> {_halve(args.max_prompt_length)}",
                        replace(args, max_prompt_length=_halve(args.max_prompt_length))))
    elif args.max_length > 16:
        out.append((f"max_length {args.max_length} -> {_halve(args.max_length)}",
                    replace(args, max_length=_halve(args.max_length))))
    if args.quantization != "nf4":
        out.append(("quantization none -> nf4 (4-bit base)", replace(args, quantization="nf4")))
    if args.lora_r > 1:
        out.append((f"lora_r {args.lora_r} -> {_halve(args.lora_r)}", replace(args, lora_r=_halve(args.lora_r))))
    if args.optimizer != "deepspeed_zero2_offload":
        out.append(("optimizer -> deepspeed_zero2_offload (states in host RAM)",
                    replace(args, optimizer="deepspeed_zero2_offload")))
    return out


def suggest(shape: ModelShape, args, est: dict) -> list[dict]:
    """Each candidate alone (peak after, saving), then the first cumulative prefix that fits."""
    rows = []
    for description, changed in candidates(args):
        after = estimate(shape, changed)
        saving = est["peak_bytes"] - after["peak_bytes"]
        if saving > 0:
            rows.append({"change": description, "peak_bytes": after["peak_bytes"], "saving_bytes": saving,
                         "fits": after["fits"]})
    return rows


def plan_to_fit(shape: ModelShape, args) -> Optional[list[str]]:
    """Changes applied one after another until the estimate fits: the first candidate (in the
    suggestion order) that fits alone ends the plan; otherwise the one that saves most is taken."""
    steps: list[str] = []
    current = args
    for _ in range(32):
        peak = estimate(shape, current)
        if peak["fits"]:
            return steps
        tried = [(d, c, estimate(shape, c)) for d, c in candidates(current)]
        fitting = [(d, c) for d, c, e in tried if e["fits"]]
        if fitting:
            return steps + [fitting[0][0]]
        better = [(e["peak_bytes"], i) for i, (_, _, e) in enumerate(tried) if e["peak_bytes"] < peak["peak_bytes"]]
        if not better:
            return None
        description, current, _ = tried[min(better)[1]]
        steps.append(description)
    return None


def advice_lines(shape: ModelShape, args, est: dict) -> tuple[list[str], list[dict]]:
    rows = suggest(shape, args, est)
    budget = args.budget_bytes
    if est["fits"]:
        lines = [f"headroom: {C.gib(budget - est['peak_bytes'])} GiB"]
    else:
        lines = [f"over budget by {C.gib(est['peak_bytes'] - budget)} GiB; changes, each alone:"]
    if not est["fits"]:
        for row in rows:
            lines.append(f"  - {row['change']}: peak {C.gib(row['peak_bytes'])} GiB "
                         f"(-{C.gib(row['saving_bytes'])}){' fits' if row['fits'] else ''}")
        plan = plan_to_fit(shape, args)
        if plan is None:
            lines.append("  no combination of these changes fits the budget")
        else:
            lines.append("  to fit, in order: " + "; ".join(plan))
    return lines, rows
