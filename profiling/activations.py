"""Activation, logits and KV-cache memory of a Llama decoder with LoRA, as explicit formulas.

Bytes per token unless named otherwise. Per decoder layer, with a trainable adapter active, autograd saves
the RMSNorms' fp32 inputs, each LoRA target's fp32 dropout output and mask, attention's q, k, v, output and
logsumexp, and the MLP's gate, up and SiLU outputs; frozen base linears save nothing. No-grad passes save
nothing; with gradient checkpointing each layer keeps only its input. The term-by-term table:
docs/memory.md, "Activation bytes per layer".
"""

from __future__ import annotations

from dataclasses import dataclass

from profiling.shapes import LORA_BYTES, ModelShape, lora_targets


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
    logprob_chunk: int = 1024  # positions upcast to fp32 at once (trainer.model.logprobs.DEFAULT_CHUNK_SIZE)
    nf4: bool = True


# LoRA layers that read the same tensor: the attention block's normed input, the MLP's.
SHARED_INPUT = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "gate_proj": "mlp", "up_proj": "mlp"}


def _mask_bytes(spec: ForwardSpec) -> int:
    return 1 if spec.device == "cuda" else LORA_BYTES


def layer_saved_per_token(shape: ModelShape, spec: ForwardSpec, seq_len: int) -> int:
    """Bytes one decoder layer saves for backward, per token, with a trainable adapter active."""
    h, i, a, r = shape.hidden_size, shape.intermediate_size, spec.dtype_bytes, spec.lora_rank
    n_h, n_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    norms = 2 * (4 * h + 4)
    targets = lora_targets(shape, spec.lora_targets)
    if spec.lora_dropout:  # each LoRA layer's own dropped copy of its input, and the mask
        inputs = sum((_mask_bytes(spec) + LORA_BYTES) * n_in for _, n_in, _ in targets)
    elif a == LORA_BYTES:  # the input itself, saved once by the LoRA layers that read it (q, k, v; gate, up);
        # o_proj's is the attention kernel's output, which it saves already (`attention` below)
        read = {(SHARED_INPUT.get(name, name), n_in) for name, n_in, _ in targets}
        inputs = LORA_BYTES * sum(n_in for group, n_in in read if not (group == "o_proj" and spec.attention != "eager"))
    else:  # each LoRA layer's own cast of its input to the LoRA weights' dtype
        inputs = LORA_BYTES * sum(n_in for _, n_in, _ in targets)
    lora = inputs + sum(LORA_BYTES * r for _ in targets)
    attention = a * (2 * n_h * d + 2 * n_kv * d) + 4 * n_h
    if spec.attention == "eager":
        attention += 6 * n_h * seq_len + a * 2 * (n_h - n_kv) * d  # fp32 + bf16 probabilities, repeated k/v
    mlp = 3 * a * i
    return norms + lora + attention + mlp


def first_layer_savings_per_token(shape: ModelShape, spec: ForwardSpec) -> int:
    """What layer 0 does not save because its input needs no gradient (see the module docstring)."""
    fed_by_input_norm = ("q_proj", "k_proj", "v_proj")
    masks = sum(n_in for name, n_in, _ in lora_targets(shape, spec.lora_targets) if name in fed_by_input_norm)
    return 4 * shape.hidden_size + 4 + (_mask_bytes(spec) * masks if spec.lora_dropout else 0)


def _all_layers_saved_per_token(shape: ModelShape, spec: ForwardSpec, seq_len: int) -> int:
    """Every layer's saved tensors, the final RMSNorm's fp32 input and RoPE's cos/sin, per token."""
    return (shape.num_layers * layer_saved_per_token(shape, spec, seq_len) - first_layer_savings_per_token(shape, spec)
            + 4 * shape.hidden_size + 4 + 2 * spec.dtype_bytes * shape.head_dim)


def layer_backward_temporaries_per_token(shape: ModelShape, spec: ForwardSpec) -> int:
    """Gradients alive inside one layer's backward (approximate): the MLP's, the largest ones."""
    i, a = shape.intermediate_size, spec.dtype_bytes
    return (3 * a + LORA_BYTES) * i + 4 * shape.hidden_size


def dequantized_weight_bytes(shape: ModelShape, spec: ForwardSpec) -> int:
    """4-bit matmuls dequantize one weight at a time to the compute dtype (forward and backward)."""
    if not spec.nf4:
        return 0
    return max(a * b for _, a, b in shape.linears()) * spec.dtype_bytes


def nograd_layer_per_token(shape: ModelShape, spec: ForwardSpec, seq_len: int) -> int:
    """Peak temporaries of one layer in a forward without autograd (approximate): the residual
    stream plus the larger of the attention block and the MLP block, with their fp32 norm copy
    and the fp32 LoRA input cast."""
    h, i, a = shape.hidden_size, shape.intermediate_size, spec.dtype_bytes
    n_h, n_kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    attention = 4 * h + a * (h + 2 * n_h * d + 2 * n_kv * d) + LORA_BYTES * h
    if spec.attention == "eager":
        attention += 6 * n_h * seq_len
    mlp = 4 * h + a * (h + 3 * i) + LORA_BYTES * i
    return 2 * a * h + max(attention, mlp)


# ---------------------------------------------------------------- whole passes (bytes)


def _upcast_bytes(spec: ForwardSpec) -> int:
    """An fp32 copy of logits per element; none when the compute dtype is fp32 already (`.to` returns the tensor)."""
    return 4 if spec.dtype_bytes < 4 else 0


def _chunked_backward(per_chunk: int, first: int, second: int) -> int:
    """Peak of a chunked softmax backward, per vocabulary entry: the chunk in work (`per_chunk` bytes per
    logit) beside the previous chunk's fp32 gradient, which its loop variable holds until replaced."""
    return max(first * per_chunk, 4 * first + second * per_chunk)


def _chunks(chunk: int, positions: int) -> tuple[int, int]:
    """Positions in the first and the second chunk of `positions` split `chunk` at a time."""
    first = min(chunk, positions)
    return first, min(chunk, positions - first)


def logits_training(shape: ModelShape, spec: ForwardSpec, tokens: int) -> int:
    """At the start of backward: the (tokens x V) logits kept by the chunked log-prob and their gradient;
    inside the chunked softmax backward two fp32 temporaries of the chunk in work (logits - lse, its exp;
    then the exp and the gradient; the fp32 upcast dies at the first), beside the previous chunk's gradient."""
    V, a = shape.vocab_size, spec.dtype_bytes
    return 2 * tokens * V * a + V * _chunked_backward(2 * 4, *_chunks(spec.logprob_chunk, tokens))


def logits_nograd(shape: ModelShape, spec: ForwardSpec, tokens: int) -> int:
    """A scoring pass: the full (tokens x V) logits, and for one chunk their fp32 upcast (none in fp32) and
    the log-sum-exp's fp32 temporary."""
    V = shape.vocab_size
    chunk = min(spec.logprob_chunk, tokens)
    return tokens * V * spec.dtype_bytes + chunk * V * (_upcast_bytes(spec) + 4)


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


def training_activations(shape: ModelShape, spec: ForwardSpec, tokens: int, seq_len: int) -> int:
    """Peak activation bytes (logits excluded) of forward + backward over `tokens` tokens."""
    L, h, a = shape.num_layers, shape.hidden_size, spec.dtype_bytes
    if spec.checkpointing:
        kept = tokens * (L * a * h + 4 * h + 4)  # each layer's input; the final norm is not checkpointed
        recompute = tokens * (layer_saved_per_token(shape, spec, seq_len)
                              + layer_backward_temporaries_per_token(shape, spec))
        return kept + recompute + dequantized_weight_bytes(shape, spec)
    saved = saved_for_backward(shape, spec, tokens, seq_len)
    return saved + tokens * layer_backward_temporaries_per_token(shape, spec) + dequantized_weight_bytes(shape, spec)


def saved_for_backward(shape: ModelShape, spec: ForwardSpec, tokens: int, seq_len: int) -> int:
    """Bytes saved by one forward without checkpointing (the figure `SavedTensorMeter` measures)."""
    return tokens * _all_layers_saved_per_token(shape, spec, seq_len)


def nograd_activations(shape: ModelShape, spec: ForwardSpec, tokens: int, seq_len: int) -> int:
    return tokens * nograd_layer_per_token(shape, spec, seq_len) + dequantized_weight_bytes(shape, spec)


def kv_cache(shape: ModelShape, spec: ForwardSpec, batch: int, context: int) -> int:
    """2 (K and V) x layers x kv heads x head dim x context x batch x dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * context * batch * spec.dtype_bytes


def kv_cache_growth(shape: ModelShape, spec: ForwardSpec, batch: int, context: int) -> int:
    """transformers' DynamicCache grows by torch.cat: one layer's old and new K, V coexist briefly."""
    return kv_cache(shape, spec, batch, context) // shape.num_layers
