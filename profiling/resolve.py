"""What the 'auto' settings become on a device: the one rule for quantization, compute dtype, optimizer
and the rollouts' decode path, used alike by the trainer (what it loads), the estimator (what it predicts) and the
benchmarks (what both sides of a comparison run with).
"""

from __future__ import annotations

from typing import Optional

from foundation.settings import DECODE_CHOICES, DTYPES, OPTIMIZER_NAMES, QUANTIZATIONS

def bitsandbytes_unavailable_reason() -> Optional[str]:
    """None when bitsandbytes imports here, else a one-line reason."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # an import error or a broken native library
        return f"bitsandbytes is not usable ({type(exc).__name__}: {exc})"
    return None


def four_bit(quantization: str, device_type: str, bnb_reason: Optional[str] = None) -> bool:
    """True for 4-bit NF4. 'auto' is NF4 only on CUDA with a working bitsandbytes.

    `bnb_reason` is `bitsandbytes_unavailable_reason()` (None: it works); an explicit 'nf4' without it
    is an error, since the run would otherwise hold a base four times the size it planned for.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization '{quantization}': use {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return False
    if quantization == "nf4":
        if bnb_reason:
            raise ValueError(f"quantization=nf4 asked for, but {bnb_reason}")
        return True
    return device_type == "cuda" and bnb_reason is None


def compute_dtype(dtype: str, device_type: str, nf4: bool, bf16_supported: bool = True) -> str:
    """'auto' is bfloat16 on a GPU that has it (float16 on an older one) and float32 on CPU; a 4-bit
    base computes in bfloat16 whatever was asked (fp32 compute only doubles the dequantization cost)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    if dtype == "auto":
        name = ("bfloat16" if bf16_supported else "float16") if device_type == "cuda" else "float32"
    else:
        name = DTYPES[dtype]
    return "bfloat16" if nf4 and name == "float32" else name


def optimizer(name: str, device_type: str, bnb_ok: bool = True) -> str:
    """'auto' is bitsandbytes' paged 8-bit AdamW on CUDA and torch AdamW on CPU; paging needs CUDA, so a
    paged request on CPU becomes the plain 8-bit AdamW."""
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer '{name}': use one of {', '.join(OPTIMIZER_NAMES)}")
    if name == "auto":
        return "paged_adamw_8bit" if device_type == "cuda" and bnb_ok else "adamw_torch"
    if name in ("paged_adamw_8bit", "adamw_8bit") and not bnb_ok:
        raise ValueError(f"optimizer {name} needs bitsandbytes, which does not import here")
    if name == "paged_adamw_8bit" and device_type != "cuda":
        return "adamw_8bit"
    return name


def decode_path(decode: str, device_type: str, offload_embeddings: bool = False, sharded: bool = False) -> str:
    """--decode 'auto': compiled on CUDA, where capturing each step as CUDA graphs removes the per-token launch
    overhead that dominates decoding; eager on the CPU (nothing to capture), with the input embedding in host
    memory (a captured step cannot look rows up there) and under ZeRO-3 / FSDP (their gather hooks)."""
    if decode not in DECODE_CHOICES:
        raise ValueError(f"unknown decode path '{decode}': use {', '.join(DECODE_CHOICES)}")
    if decode != "auto":
        return decode
    return "compiled" if device_type == "cuda" and not offload_embeddings and not sharded else "eager"
