"""Activation, logits and KV-cache memory of a Llama decoder with LoRA, as explicit formulas.

Bytes per token unless named otherwise. Per decoder layer, with a trainable adapter active, autograd saves
the RMSNorms' fp32 inputs, each LoRA target's fp32 dropout output and mask (under autocast: the compute-dtype
cast of it), attention's q, k, v, output and logsumexp, and the MLP's gate, up and SiLU outputs; frozen base
linears save nothing. No-grad passes save nothing; with gradient checkpointing each layer keeps only its
input. A training pass peaks either in the LM head's backward or in a layer's, never both at once
(`training_parts`). The term-by-term table: docs/memory.md, "Activation bytes per layer".
"""

from __future__ import annotations

from dataclasses import dataclass

from profiling.shapes import LORA_BYTES, ModelShape, lora_targets, lora_tensor_sizes


@dataclass(frozen=True)
class ForwardSpec:
    """What a forward pass looks like, beyond the model shape."""

    dtype_bytes: int = 2
    lora_rank: int = 16
    lora_targets: str = "all-linear"
    lora_dropout: bool = True  # trainable adapters keep dropout; frozen ones have none
    device: str = "cuda"
    attention: str = "sdpa"  # sdpa / flash_attention_2 keep no seq x seq tensor; eager does
    checkpointing: bool = True
    nf4: bool = True
    autocast: bool = False  # training under mixed precision (Accelerate's autocast; CUDA's default)
    offload: bool = False  # what a training pass keeps goes to host memory (trainer/model/offload.py; CUDA)

    @property
    def casts_lora(self) -> bool:
        """Whether autocast casts the fp32 LoRA matmuls' inputs and weights to a 2-byte compute dtype."""
        return self.autocast and self.dtype_bytes < LORA_BYTES


# LoRA layers that read the same tensor: the attention block's normed input, the MLP's.
SHARED_INPUT = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "gate_proj": "mlp", "up_proj": "mlp"}

FED_BY_INPUT_NORM = ("q_proj", "k_proj", "v_proj")  # layer 0's: their input, the embedding's, needs no gradient


def _mask_bytes(spec: ForwardSpec) -> int:
    return 1 if spec.device == "cuda" else LORA_BYTES


def layer_saved_per_token(shape: ModelShape, spec: ForwardSpec, seq_len: int, groups: int = 1) -> int:
    """Bytes one decoder layer saves for backward, per token, with a trainable adapter active; in a routed pass of
    `groups` adapters each token's LoRA-A products span all their ranks (trainer.model.routing)."""
    h, a, r = shape.hidden_size, spec.dtype_bytes, spec.lora_rank
    norms = 2 * (4 * h + 4)
    targets = lora_targets(shape, spec.lora_targets)
    width = a if spec.casts_lora else LORA_BYTES  # what the LoRA products compute in: autocast's dtype, or fp32
    if spec.lora_dropout:  # each LoRA layer's own dropped copy of its input, and the mask
        inputs = sum((_mask_bytes(spec) + width) * n_in for _, n_in, _ in targets)
    elif spec.casts_lora or a == LORA_BYTES:  # the input itself, in its dtype already (trainer.model.routing)
        inputs = _shared_inputs(shape, spec, width)
    else:  # each LoRA layer's own cast of its input to the LoRA weights' dtype
        inputs = LORA_BYTES * sum(n_in for _, n_in, _ in targets)
    return norms + inputs + sum(width * r * groups for _ in targets) + _attention_and_mlp(shape, spec, seq_len)


def _shared_inputs(shape: ModelShape, spec: ForwardSpec, width: int) -> int:
    """LoRA inputs saved as they are: once by the layers that read the same tensor (q, k, v; gate, up), and
    none for o_proj, whose input is the attention kernel's output, saved already (`_attention_and_mlp`)."""
    read = {(SHARED_INPUT.get(name, name), n_in) for name, n_in, _ in lora_targets(shape, spec.lora_targets)}
    return width * sum(n_in for group, n_in in read if not (group == "o_proj" and spec.attention != "eager"))


def _attention_and_mlp(shape: ModelShape, spec: ForwardSpec, seq_len: int) -> int:
    """Attention's q, k, v, output and logsumexp, the MLP's gate, up and SiLU outputs, per token."""
    a, n_h, n_kv, d = spec.dtype_bytes, shape.num_heads, shape.num_kv_heads, shape.head_dim
    attention = a * (2 * n_h * d + 2 * n_kv * d) + 4 * n_h
    if spec.attention == "eager":
        attention += 6 * n_h * seq_len + a * 2 * (n_h - n_kv) * d  # fp32 + bf16 probabilities, repeated k/v
    return attention + 3 * a * shape.intermediate_size


def first_layer_savings_per_token(shape: ModelShape, spec: ForwardSpec) -> int:
    """What layer 0 does not save because its input needs no gradient (see the module docstring)."""
    masks = sum(n_in for name, n_in, _ in lora_targets(shape, spec.lora_targets) if name in FED_BY_INPUT_NORM)
    return 4 * shape.hidden_size + 4 + (_mask_bytes(spec) * masks if spec.lora_dropout else 0)


def _all_layers_saved_per_token(shape: ModelShape, spec: ForwardSpec, seq_len: int, groups: int = 1) -> int:
    """Every layer's saved tensors, the final RMSNorm's fp32 input and RoPE's cos/sin, per token."""
    return (shape.num_layers * layer_saved_per_token(shape, spec, seq_len, groups)
            - first_layer_savings_per_token(shape, spec)
            + 4 * shape.hidden_size + 4 + 2 * spec.dtype_bytes * shape.head_dim)


def layer_backward_temporaries_per_token(shape: ModelShape, spec: ForwardSpec) -> int:
    """Gradients alive inside one layer's backward, beyond its saved tensors (approximate): the MLP's, the largest
    ones - at down_proj's backward the input's gradient through the base weight, through the LoRA path and their
    sum, by when down_proj's saved input is freed (three tensors of its size for one), and where the compute
    dtype is narrower than the LoRA weights the LoRA path's fp32 gradient before its cast back. (The LoRA
    scaling multiplies rank-wide outputs, trainer.model.routing: no scaled copy of the output's gradient.)"""
    i, a = shape.intermediate_size, spec.dtype_bytes
    return (2 * a + (LORA_BYTES if a < LORA_BYTES else 0)) * i


def dequantized_weight_bytes(shape: ModelShape, spec: ForwardSpec) -> int:
    """4-bit matmuls dequantize one weight at a time to the compute dtype (forward and backward)."""
    if not spec.nf4:
        return 0
    return max(a * b for _, a, b in shape.linears()) * spec.dtype_bytes


def nograd_layer_per_token(shape: ModelShape, spec: ForwardSpec, seq_len: int) -> int:
    """Peak temporaries of one layer in a forward without autograd (approximate): the residual
    stream plus the larger of the attention block and the MLP block, with their fp32 norm copy
    and the LoRA input's fp32 cast (none in fp32, nor under autocast, where the input goes into the LoRA
    matmuls as it is: trainer.model.routing)."""
    h, i, a = shape.hidden_size, shape.intermediate_size, spec.dtype_bytes
    n_h, n_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    cast = LORA_BYTES if a < LORA_BYTES and not spec.autocast else 0
    attention = 4 * h + a * (h + 2 * n_h * d + 2 * n_kv * d) + cast * h
    if spec.attention == "eager":
        attention += 6 * n_h * seq_len
    mlp = 4 * h + a * (h + 3 * i) + cast * i
    return 2 * a * h + max(attention, mlp)


# ---------------------------------------------------------------- whole passes (bytes)


def _chunked_backward(per_chunk: int, first: int, second: int) -> int:
    """Peak of a chunked softmax backward, per vocabulary entry: the chunk in work (`per_chunk` bytes per
    logit) beside the previous chunk's fp32 gradient, which its loop variable holds until replaced."""
    return max(first * per_chunk, 4 * first + second * per_chunk)


def _chunks(chunk: int, positions: int) -> tuple[int, int]:
    """Positions in the first and the second chunk of `positions` split `chunk` at a time."""
    first = min(chunk, positions)
    return first, min(chunk, positions - first)


# trainer.model.logprobs.head_logprobs runs the output layer over as many positions at once as make 2**24 logits: a
# 64 MiB fp32 temporary whatever the vocabulary (341 positions of SmolLM2's 49k vocabulary, 524 of Llama-2's 32k).
HEAD_CHUNK_ELEMENTS = 2 ** 24


def head_chunk_positions(vocab_size: int) -> int:
    """Positions per chunk of `head_logprobs`: (positions x vocab) fp32 temporaries of HEAD_CHUNK_ELEMENTS."""
    return max(1, HEAD_CHUNK_ELEMENTS // vocab_size)


def head_logprobs_training(shape: ModelShape, spec: ForwardSpec, tokens: int) -> int:
    """Log-probs straight from the hidden states (trainer.model.logprobs.head_logprobs: every stage's; PPO's and
    GRPO's at a temperature and with the entropy): no (tokens x V) tensor. Its backward works in place: per
    logit of the chunk, the product in the compute dtype (in fp32 it is the first buffer itself) and two fp32
    buffers (log p, then p), beside the previous chunk's gradient; its forward holds less."""
    chunks = _chunks(head_chunk_positions(shape.vocab_size), tokens)
    return shape.vocab_size * _chunked_backward((spec.dtype_bytes if spec.dtype_bytes < 4 else 0) + 2 * 4, *chunks)


def head_logprobs_nograd(shape: ModelShape, spec: ForwardSpec, tokens: int) -> int:
    """The same without gradient (DPO's reference): a chunk's fp32 logits (the compute dtype's copy dies at
    the upcast) and the log-sum-exp's fp32 temporary."""
    return min(head_chunk_positions(shape.vocab_size), tokens) * shape.vocab_size * 2 * 4


def head_inputs(shape: ModelShape, spec: ForwardSpec, tokens: int, positions: int, backward: bool = True) -> int:
    """Beside the LM head's chunks: the final hidden states of all `tokens`, which the caller holds while the
    head runs, and at the head's `positions` their gathered hidden states, with a backward also three
    gradients of that size (the gathered states', the chunk's, their sum)."""
    return spec.dtype_bytes * shape.hidden_size * (tokens + (4 if backward else 1) * positions)


def lora_weight_casts(shape: ModelShape, spec: ForwardSpec, adapters: int = 1) -> int:
    """The LoRA weights' copies a training pass holds. One adapter's: autocast's compute-dtype casts, cached from
    their first use in the forward until autocast exits after the backward (none without autocast or in fp32).
    A routed pass of several multiplies their stacked weights (trainer.model.routing), which every layer's
    matmuls save, in the compute dtype under autocast, else in fp32: all layers' at once without
    checkpointing, one layer's at a time with it (`training_parts`)."""
    if adapters > 1:
        return adapters * (spec.dtype_bytes if spec.casts_lora else LORA_BYTES) * \
            sum(lora_tensor_sizes(shape, spec.lora_rank, spec.lora_targets))
    if not spec.casts_lora:
        return 0
    return spec.dtype_bytes * sum(lora_tensor_sizes(shape, spec.lora_rank, spec.lora_targets))


def training_parts(shape: ModelShape, spec: ForwardSpec, tokens: int, seq_len: int,
                   adapters: int = 1) -> tuple[int, int, int]:
    """(kept, layer, host): the activation bytes alive on the device from the forward through the whole
    backward - every layer's saved tensors, or with checkpointing each layer's input - and what one layer's
    backward adds on top (with checkpointing its recomputed saved tensors), the MLP's gradients and a
    dequantized 4-bit weight. The LM head's backward runs beside `kept` alone, before any layer's: a training
    pass peaks at kept + max(layer, head). With `spec.offload` what would be kept waits in host memory
    (`host`) and comes back a layer at a time. `adapters`: trainable adapters in the pass (PPO's policy and
    value)."""
    L, h, a = shape.num_layers, shape.hidden_size, spec.dtype_bytes
    casts = lora_weight_casts(shape, spec, adapters)
    temporaries = tokens * layer_backward_temporaries_per_token(shape, spec) + dequantized_weight_bytes(shape, spec)
    saved = tokens * layer_saved_per_token(shape, spec, seq_len, adapters)
    if spec.checkpointing:
        kept, layer = tokens * (L * a * h + 4 * h + 4), saved + temporaries  # the final norm is not checkpointed
        if adapters > 1:  # routed: the stacked weights of the layer recomputed, not all layers'
            layer, casts = layer + casts // L, 0
    else:
        kept, layer = tokens * _all_layers_saved_per_token(shape, spec, seq_len, adapters), temporaries
    if not spec.offload:
        return kept + casts, layer, 0
    # back on the device: one layer's input (the head's hidden states first), without checkpointing its saves
    back = tokens * a * h + (0 if spec.checkpointing else saved)
    return casts, layer + back, kept


def saved_for_backward(shape: ModelShape, spec: ForwardSpec, tokens: int, seq_len: int) -> int:
    """Bytes saved by one forward without checkpointing (the figure `SavedTensorMeter` measures): with autocast
    also the LoRA weights' casts, less layer 0's q, k, v lora_A (their input needs no gradient)."""
    casts = lora_weight_casts(shape, spec)
    if casts:
        first = sum(spec.lora_rank * n_in for name, n_in, _ in lora_targets(shape, spec.lora_targets)
                    if name in FED_BY_INPUT_NORM)
        casts -= spec.dtype_bytes * first
    return tokens * _all_layers_saved_per_token(shape, spec, seq_len) + casts


def nograd_activations(shape: ModelShape, spec: ForwardSpec, tokens: int, seq_len: int) -> int:
    return tokens * nograd_layer_per_token(shape, spec, seq_len) + dequantized_weight_bytes(shape, spec)


def kv_cache(shape: ModelShape, spec: ForwardSpec, batch: int, context: int) -> int:
    """2 (K and V) x layers x kv heads x head dim x context x batch x dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * context * batch * spec.dtype_bytes


def compiled_kv_cache(shape: ModelShape, spec: ForwardSpec, batch: int, context: int) -> int:
    """The compiled decode's static KV cache (trainer.model.decode): its length rounded up to 128 positions."""
    return kv_cache(shape, spec, batch, -(-context // 128) * 128)


def kv_cache_growth(shape: ModelShape, spec: ForwardSpec, batch: int, context: int) -> int:
    """transformers' DynamicCache grows by torch.cat: one layer's old and new K, V coexist briefly."""
    return kv_cache(shape, spec, batch, context) // shape.num_layers
