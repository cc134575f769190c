"""Optimizer-state and gradient bytes for a list of trainable fp32 tensors, per optimizer.

adamw_torch keeps two moments in the parameter dtype (8 bytes per parameter); bitsandbytes' 8-bit AdamW two
uint8 states with per-block absmax, but fp32 states for tensors under 4096 elements (most LoRA tensors), and
its paged variant puts large states in CUDA managed memory; DeepSpeed ZeRO-2 offload keeps the master copy
and moments (12 bytes per parameter) in host RAM. Gradients: 4 bytes per trainable parameter.
The exact layouts: docs/memory.md, "Optimizer-state bytes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OPTIMIZERS = ("adamw_torch", "adamw_8bit", "paged_adamw_8bit", "deepspeed_zero2_offload")
MIN_8BIT_SIZE = 4096
BLOCK_8BIT = 256
QMAP_BYTES = 2 * 256 * 4
PAGED_MIN_ELEMENTS = 100_000
STEP_BYTES = 4


@dataclass
class OptimizerBytes:
    device: int  # on the accelerator
    host: int  # in CPU RAM
    paged: int  # part of `device` that is managed (pageable) memory


def optimizer_bytes(sizes: list[int], optimizer: str, device: str = "cuda") -> OptimizerBytes:
    """State bytes after the first step for trainable tensors of `sizes` elements each."""
    if optimizer not in OPTIMIZERS:
        raise SystemExit(f"unknown optimizer '{optimizer}': use one of {', '.join(OPTIMIZERS)}")
    if optimizer == "adamw_torch":
        steps = STEP_BYTES * len(sizes)
        on_device = 8 * sum(sizes)
        return OptimizerBytes(on_device + (steps if device == "cpu" else 0), steps if device != "cpu" else 0, 0)
    if optimizer == "deepspeed_zero2_offload":
        return OptimizerBytes(0, 12 * sum(sizes), 0)
    total = paged = 0
    any_8bit = False
    for n in sizes:
        if n < MIN_8BIT_SIZE:
            size = 8 * n
        else:
            any_8bit = True
            size = 2 * n + 2 * 4 * math.ceil(n / BLOCK_8BIT)
        total += size
        if optimizer == "paged_adamw_8bit" and device == "cuda" and n >= PAGED_MIN_ELEMENTS:
            paged += 2 * n  # the uint8 (or fp32) state buffers; absmax stays ordinary device memory
    return OptimizerBytes(total + (QMAP_BYTES if any_8bit else 0), 0, paged)


def step_temporaries(sizes: list[int], optimizer: str) -> int:
    """Transient bytes inside optimizer.step(): none. The trainer runs torch's AdamW as its fused kernel
    (trainer/engine/optim.py), which updates in place as the bitsandbytes kernels do
    (benchmarks/results/activation_check-cpu holds the check)."""
    return 0


def gradient_bytes(sizes: list[int]) -> int:
    return 4 * sum(sizes)
