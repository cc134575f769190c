"""Optimizer-state and gradient bytes for a list of trainable fp32 tensors, per optimizer.

- adamw_torch: exp_avg and exp_avg_sq in the parameter dtype (fp32 LoRA): 8 bytes per parameter,
  plus a 4-byte `step` tensor per parameter tensor, kept on the host unless fused/capturable.
- adamw_8bit / paged_adamw_8bit (bitsandbytes): two uint8 states (2 bytes per parameter) plus an
  fp32 absmax per 256-value block for each state, and one pair of 256-entry fp32 quantization maps
  per optimizer; tensors under 4096 elements (min_8bit_size) get fp32 states (8 bytes per
  parameter), which for LoRA on a small model is nearly every tensor. The paged variant allocates
  the same bytes, for tensors of 1e5 elements or more, as CUDA managed memory that the driver can
  page out to host RAM under pressure (and that torch's allocator statistics do not see).
- deepspeed_zero2_offload: the fp32 master copy and both moments (12 bytes per parameter) live
  in host RAM; nothing on the GPU.
Gradients are fp32 like the LoRA weights: 4 bytes per trainable parameter.
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
    (trainer/engine/optim.py), which updates in place as the bitsandbytes kernels do (measured on the CPU
    allocator: benchmarks/results/activation_check-cpu)."""
    return 0


def gradient_bytes(sizes: list[int]) -> int:
    return 4 * sum(sizes)
