"""One decode step's attention: on a grouped-query model (several query heads per KV head: Llama 3, Qwen2,
Mistral) without repeating its KV heads, and in a compiled step writing the step's key and value into the
layer's static cache itself.

With a mask - which a static KV cache always needs - transformers' sdpa attention repeats every layer's cached
keys and values into new tensors, heads/kv_heads times their size, at every step. For a single query token the
heads that share a KV head can instead be that head's query rows: (B, heads, 1, D) viewed as (B, kv_heads,
group, D), attended against the cache as it is, the one-token mask broadcast over the rows. The same
products and softmax, with no copy of the cache.

A compiled decode step runs each decoder layer as one nested compile region whose inputs are tensors only
(`trainer.model.decode`): the layer's static-cache tensors come in as `decode_kv` and this function writes
the step into them as transformers' `StaticLayer.update` does, so torch traces the region once and reuses it
for every layer (a cache object among the inputs makes it trace each layer anew). Decoding switches a sdpa
model to this implementation (`DECODE_ATTENTION`) while it runs; every other call goes to transformers' sdpa
unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

DECODE_ATTENTION = "sdpa_decode"


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def single_token_gqa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     decode_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: (B, 1, heads, D) output. `decode_kv` (a compiled step's
    layer region): the layer's static cache (keys, values, tokens held so far), which `key` and `value` are
    written into first and then attended as the whole key and value. One query token on a grouped-query layer
    with a mask shared by all heads (or none) folds the query heads onto their KV heads; anything else (a
    longer query, per-head masks or biases, a paged cache) is transformers' sdpa."""
    if decode_kv is not None:
        key, value = write_static_cache(decode_kv, key, value)
    group = getattr(module, "num_key_value_groups", 1)
    plain = not any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "s_aux"))
    if group == 1 or query.shape[2] != 1 or not plain or (attention_mask is not None and attention_mask.shape[1] != 1):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(query.reshape(batch, heads // group, group, dim), key, value,
                                         attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def write_static_cache(decode_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], key: torch.Tensor,
                       value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`key` and `value` (B, kv_heads, T, D) written in place after the tokens a static cache layer holds, its
    count moved on, as transformers' `StaticLayer.update` does; returns the cache's keys and values."""
    keys, values, held = decode_kv
    at = torch.arange(key.shape[-2], device=key.device) + held
    held.add_(key.shape[-2])
    keys.index_copy_(2, at, key)
    values.index_copy_(2, at, value)
    return keys, values


def _registered() -> bool:
    """Register the implementation with transformers (its mask built as sdpa's) once; False where this
    transformers has no such registries."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    if DECODE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(DECODE_ATTENTION, single_token_gqa)
    if DECODE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


@contextmanager
def decode_attention(causal_lm: nn.Module) -> Iterator[None]:
    """The body's attention through `single_token_gqa` where the model runs sdpa; any other model runs as it
    is. Its setting is restored after."""
    config = causal_lm.config
    if not (getattr(config, "_attn_implementation", None) == "sdpa" and _registered()):
        yield
        return
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
