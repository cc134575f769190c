"""Component names shared by the recorder, the estimator and the reports, and the byte units.

The names are stable strings (they are JSON keys and chart labels): a recorded run and an estimate
of the same configuration can be compared key by key.
"""

from __future__ import annotations

from typing import Iterable, Mapping

# Counted exactly by walking tensors (any device).
BASE_WEIGHTS = "base_weights"  # the frozen linear layers: packed 4-bit storage, or full-precision weights
BASE_QUANT_CONSTANTS = "base_quant_constants"  # NF4 absmax, nested absmax, codebooks and offsets
BASE_OTHER = "base_other"  # embeddings, norms, lm_head, rotary buffers: never quantized
GENERATION_WEIGHTS = "generation_weights"  # dense copies of the 4-bit weights that decoding reads
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ADAPTER_PREFIX = "adapter/"
HEAD_PREFIX = "head/"

# Known from allocator statistics around a phase (CUDA; on the CPU the allocator's events, profiling.live),
# or predicted by the estimator.
ACTIVATIONS = "activations"
LOGITS = "logits"  # (tokens x vocab) logits and the chunked fp32 log-prob temporaries (estimator, CPU recorder)
KV_CACHE = "kv_cache"
ROLLOUT_BUFFERS = "rollout_buffers"
OPTIMIZER_TEMPORARIES = "optimizer_temporaries"  # buffers alive only inside optimizer.step()
OTHER_TENSORS = "other_tensors"  # live tensors at phase entry that no walked object owns (inputs, caches)
ALLOCATOR_OVERHEAD = "allocator_overhead"  # reserved minus allocated at the phase peak
CUDA_CONTEXT = "cuda_context"  # device memory outside the torch allocator (CUDA context, other processes)


# Byte units. Reports use GiB (2**30 bytes): an RTX 4090's "24 GB" is 24 GiB (24,564 MiB in nvidia-smi).
GIB = 2**30
MIB = 2**20
DEFAULT_BUDGET_BYTES = 24 * GIB

_ORDER = (BASE_WEIGHTS, BASE_QUANT_CONSTANTS, BASE_OTHER, GENERATION_WEIGHTS, ADAPTER_PREFIX, HEAD_PREFIX,
          OPTIMIZER_STATES, GRADIENTS, ACTIVATIONS, LOGITS, KV_CACHE, ROLLOUT_BUFFERS, OPTIMIZER_TEMPORARIES, OTHER_TENSORS,
          ALLOCATOR_OVERHEAD, CUDA_CONTEXT)


def adapter(name: str) -> str:
    return f"{ADAPTER_PREFIX}{name}"


def head(name: str) -> str:
    return f"{HEAD_PREFIX}{name}"


def sort_key(component: str) -> tuple[int, str]:
    """Resident memory first (base, adapters, optimizer), then what a phase adds on top."""
    for i, prefix in enumerate(_ORDER):
        if component == prefix or (prefix.endswith("/") and component.startswith(prefix)):
            return i, component
    return len(_ORDER), component


def ordered(components: Iterable[str]) -> list[str]:
    return sorted(set(components), key=sort_key)


def total(components: Mapping[str, int | None]) -> int:
    return sum(v for v in components.values() if v)


def table_unit(largest: int | float) -> tuple[str, int]:
    """GiB for real models; MiB when everything is under 1 GiB, so a tiny model's rows are not all 0.000."""
    return ("GiB", GIB) if largest >= GIB else ("MiB", MIB)


def gib(n: int | float | None, digits: int = 3) -> str:
    """Bytes as GiB with `digits` decimals; '-' for an unknown figure."""
    return "-" if n is None else f"{n / GIB:.{digits}f}"


def human(n: int | float | None) -> str:
    """Bytes in the largest unit that keeps the number readable (B, KiB, MiB, GiB)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
