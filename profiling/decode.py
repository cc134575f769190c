"""What a decode step costs in memory traffic: the bytes one step reads, the device's copy bandwidth,
and from them the bandwidth bound on decoding speed.

A decode step reads every weight once (plus the KV cache, small at rollout lengths), whatever the
batch: the bound on tokens/s at batch B is B x bandwidth / bytes read per step. PPO's rollout
metrics (`perf/decode_bandwidth_fraction`) and the GPU kit's decode benchmark both use these.
"""

from __future__ import annotations

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


def bytes_per_decode_step(model, adapter: str = "policy") -> dict[str, int]:
    """What one decode step of a shared-base model reads from memory, by part (the embedding table is
    read a row per sequence, so an untied one does not count)."""
    parts = count_tensors(model).components()
    embeddings = model.causal_lm.get_input_embeddings().weight
    head = model.causal_lm.get_output_embeddings().weight
    tied = embeddings.data_ptr() == head.data_ptr()
    embedding_bytes = 0 if tied else embeddings.numel() * embeddings.element_size()
    return {"base_weights": parts.get(C.BASE_WEIGHTS, 0), "base_quant_constants": parts.get(C.BASE_QUANT_CONSTANTS, 0),
            "norms_and_lm_head": parts.get(C.BASE_OTHER, 0) - embedding_bytes,
            f"adapter_{adapter}": parts.get(C.adapter(adapter), 0)}


def bandwidth_fraction(tokens_per_s: float, rows: int, step_bytes: int, bandwidth: float) -> float:
    """Decoding speed over its bound, rows x bandwidth / bytes read per step."""
    return tokens_per_s / (rows * bandwidth / step_bytes)
