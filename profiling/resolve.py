"""What the 'auto' settings become on a device: the one rule for quantization, compute dtype, optimizer,
attention and the rollouts' decode path, used alike by the trainer (what it loads), the estimator (what it predicts) and the
benchmarks (what both sides of a comparison run with).
"""

from __future__ import annotations

import functools
import importlib.util
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


ATTENTION_SUPPORT = {"flash_attention_2": "_supports_flash_attn", "sdpa": "_supports_sdpa"}  # transformers' flags


def causal_lm_class(config) -> Optional[type]:
    """The transformers causal-LM class `config` builds; None where transformers maps none (a model with its
    own code), whose attention support is then not known before loading."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.models.auto.auto_factory import _get_model_class  # what from_pretrained resolves with

        return _get_model_class(config, AutoModelForCausalLM._model_mapping)
    except (ImportError, KeyError, ValueError):
        return None


@functools.cache
def class_of_model_type(model_type: str) -> Optional[type]:
    """The causal-LM class of a config's `model_type` (llama, gemma2, ...); None where transformers has none."""
    from transformers import AutoConfig

    try:
        return causal_lm_class(AutoConfig.for_model(model_type))
    except (KeyError, ValueError):
        return None


def unsupported_attention(kind: str, model_class: Optional[type]) -> Optional[str]:
    """Why `model_class` cannot run attention `kind` (flash_attention_2, sdpa), or None (an unknown class: it can)."""
    if model_class is None or getattr(model_class, ATTENTION_SUPPORT[kind], False):
        return None
    return f"{model_class.__name__} does not support {kind}"


def attention(requested: str, device_type: str, model_class: Optional[type] = None) -> tuple[str, Optional[str]]:
    """(the attention implementation a model of `model_class` loads with, why not flash_attention_2 or None).
    auto and flash_attention_2: flash-attention 2 where flash-attn imports on CUDA and the class supports it,
    else sdpa where it supports that, else eager; sdpa and eager as given (whether the class supports an
    explicit choice is the loader's check)."""
    if requested in ("sdpa", "eager"):
        return requested, None
    flash = unsupported_attention("flash_attention_2", model_class)
    if flash is None and device_type != "cuda":
        flash = "no CUDA device"
    elif flash is None and importlib.util.find_spec("flash_attn") is None:
        flash = "flash-attn is not installed (pip install 'onebase-rlhf[flash]')"
    if flash is None:
        return "flash_attention_2", None
    return ("eager" if unsupported_attention("sdpa", model_class) else "sdpa"), flash
