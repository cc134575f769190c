"""One decode step's attention on a grouped-query model (several query heads per KV head: Llama 3, Qwen2,
Mistral) without repeating its KV heads.

With a mask - which a static KV cache always needs - transformers' sdpa attention repeats every layer's cached
keys and values into new tensors, heads/kv_heads times their size, at every step. For a single query token the
heads that share a KV head can instead be that head's query rows: (B, heads, 1, D) viewed as (B, kv_heads,
group, D), attended against the cache as it is, the one-token mask broadcast over the rows. The same
products and softmax, with no copy of the cache. Decoding switches a model to this implementation (`SINGLE_TOKEN_GQA`)
while it runs; every other call goes to transformers' sdpa unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

SINGLE_TOKEN_GQA = "sdpa_single_token_gqa"


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def single_token_gqa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: (B, 1, heads, D) output. One query token on a grouped-query
    layer with a mask shared by all heads (or none) folds the query heads onto their KV heads; anything else
    (a longer query, per-head masks or biases, a paged cache) is transformers' sdpa."""
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


def _registered() -> bool:
    """Register the implementation with transformers (its mask built as sdpa's) once; False where this
    transformers has no such registries."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    if SINGLE_TOKEN_GQA not in AttentionInterface._global_mapping:
        AttentionInterface.register(SINGLE_TOKEN_GQA, single_token_gqa)
    if SINGLE_TOKEN_GQA not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(SINGLE_TOKEN_GQA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


@contextmanager
def folded_gqa(causal_lm: nn.Module) -> Iterator[None]:
    """The body's attention through `single_token_gqa` where the model runs sdpa with grouped-query attention;
    any other model runs as it is. Its setting is restored after."""
    config = causal_lm.config
    grouped = getattr(config, "num_key_value_heads", None) not in (None, getattr(config, "num_attention_heads", None))
    if not (grouped and getattr(config, "_attn_implementation", None) == "sdpa" and _registered()):
        yield
        return
    config._attn_implementation = SINGLE_TOKEN_GQA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
