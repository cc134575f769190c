"""What a decode step costs in memory traffic: the bytes one step reads, the device's copy bandwidth,
and from them the bandwidth bound on decoding speed.

A decode step reads every weight once (plus the KV cache, small at rollout lengths), whatever the
batch: the bound on tokens/s at batch B is B x bandwidth / bytes read per step. PPO's rollout
metrics (`perf/decode_bandwidth_fraction`) and the GPU kit's decode benchmark both use these.
"""

from __future__ import annotations

import math
import time

import torch

from profiling import components as C
from profiling.tensors import count_tensors


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gib: float = 0.25, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    n = int(gib * 2**30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    sync(device)
    seconds = time.perf_counter() - started
    del a, b
    return 2 * n * repeats / seconds


def dense_weight_bytes(model) -> int:
    """The bytes of a dense copy of every 4-bit weight of `model` in its layer's compute dtype (0: none)."""
    sizes = {}  # by weight: a LoRA layer shows its base layer's weight as its own
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and hasattr(module, "compute_dtype"):
            dtype = module.compute_dtype or state.dtype
            sizes[id(weight)] = math.prod(state.shape) * torch.empty(0, dtype=dtype).element_size()
    return sum(sizes.values())


def bytes_per_decode_step(model, adapter: str = "policy", weights: str = "quantized") -> dict[str, int]:
    """What one decode step of a shared-base model reads from memory, by part (the embedding table is
    read a row per sequence, so an untied one does not count). `weights` is what the step decodes from
    (`--generation_weights`): a dense copy of the 4-bit weights is read in place of them and their constants."""
    parts = count_tensors(model).components()
    embeddings = model.causal_lm.get_input_embeddings().weight
    head = model.causal_lm.get_output_embeddings().weight
    tied = embeddings.data_ptr() == head.data_ptr()
    embedding_bytes = 0 if tied else embeddings.numel() * embeddings.element_size()
    dense = dense_weight_bytes(model) if weights in ("dequantized", "resident") else 0
    base = ({C.GENERATION_WEIGHTS: dense} if dense else
            {"base_weights": parts.get(C.BASE_WEIGHTS, 0), "base_quant_constants": parts.get(C.BASE_QUANT_CONSTANTS, 0)})
    return {**base, "norms_and_lm_head": parts.get(C.BASE_OTHER, 0) - embedding_bytes,
            f"adapter_{adapter}": parts.get(C.adapter(adapter), 0)}


def bandwidth_fraction(tokens_per_s: float, rows: int, step_bytes: int, bandwidth: float) -> float:
    """Decoding speed over its bound, rows x bandwidth / bytes read per step."""
    return tokens_per_s / (rows * bandwidth / step_bytes)
