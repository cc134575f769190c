"""Log-probs and entropy of a causal LM's outputs, in chunks: the (tokens x vocab) fp32 tensors are never held whole.

`token_logprobs` and `entropy_from_logits` take ALIGNED (B, T, V) logits and (B, T) labels (position t of
`labels` is the token that position t of `logits` predicts); `shift_for_next_token` makes that alignment
without copying. `head_logprobs` takes the hidden states and the output layer instead of logits. Labels
equal to `IGNORE_INDEX` give 0. Figures come back in fp32 (fp64 stays fp64); gradients in the input's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from profiling.activations import head_chunk_positions

IGNORE_INDEX = -100
# Positions upcast to fp32 at once: 1024 x 32k vocab x 4 bytes = 128 MiB, against ~4 GiB for the
# whole (8 x 1024 x 32k) fp32 log-softmax the chunking avoids.
DEFAULT_CHUNK_SIZE = 1024


def shift_for_next_token(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V), (B, T) -> (B, T-1, V), (B, T-1): logits[:, t] paired with labels[:, t+1]. Views, no copy."""
    return logits[:, :-1, :], labels[:, 1:]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocks(batch: int, time: int, chunk_size: int):
    """Slices (rows, cols) tiling (batch, time) with at most `chunk_size` positions per tile.

    Tiles are 2-D views of the (possibly non-contiguous, e.g. shifted) logits, so no (B*T, V)
    reshape copy is ever made.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cols = max(1, min(time, chunk_size))
    rows = max(1, chunk_size // cols)
    for b in range(0, batch, rows):
        for t in range(0, time, cols):
            yield slice(b, b + rows), slice(t, t + cols)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")


def _chunk_logprobs(z: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(z)[label], 0 where the label is IGNORE_INDEX; log-sum-exp) of one chunk of logits `z`."""
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, label.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(label != IGNORE_INDEX, picked - lse, 0.0), lse


def _chunk_logprob_grad(z: torch.Tensor, lse: torch.Tensor, label: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient at one chunk of logits `z` of `_chunk_logprobs` weighted by `grad_out`, in lse's dtype:
    grad_out * (onehot(label) - softmax(z)), nothing from ignored labels."""
    g = torch.where(label != IGNORE_INDEX, grad_out, 0.0).to(lse.dtype).unsqueeze(-1)
    dz = torch.exp(z.to(lse.dtype) - lse.unsqueeze(-1)) * -g
    dz.scatter_add_(-1, label.clamp(min=0).unsqueeze(-1), g)
    return dz


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[label] whose backward recomputes softmax per chunk instead of keeping it."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        out = torch.zeros(labels.shape, dtype=dtype, device=logits.device)
        lse = torch.zeros_like(out)
        for rows, cols in _blocks(labels.shape[0], labels.shape[1], chunk_size):
            out[rows, cols], lse[rows, cols] = _chunk_logprobs(logits[rows, cols].to(dtype), labels[rows, cols])
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(logits, labels, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(labels.shape[0], labels.shape[1], ctx.chunk_size):
            block = _chunk_logprob_grad(logits[rows, cols], lse[rows, cols], labels[rows, cols], grad_out[rows, cols])
            grad[rows, cols] = block.to(grad.dtype)
        return grad, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """(B, T, V), aligned (B, T) labels -> (B, T) log p(label); 0 where label is IGNORE_INDEX.

    At most `chunk_size` positions are upcast to fp32 at a time, in forward and in backward; the
    gradient comes back in the logits' dtype.
    """
    _check_logits(logits)
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    return _TokenLogprobs.apply(logits, labels.long(), chunk_size)


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits) per position, recomputing softmax per chunk in backward."""

    @staticmethod
    def forward(ctx, logits, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        entropy = torch.zeros(logits.shape[:2], dtype=dtype, device=logits.device)
        lse = torch.zeros_like(entropy)
        for rows, cols in _blocks(logits.shape[0], logits.shape[1], chunk_size):
            z = logits[rows, cols].to(dtype)
            block_lse = torch.logsumexp(z, dim=-1)
            p = torch.exp(z - block_lse.unsqueeze(-1))
            entropy[rows, cols] = block_lse - (p * z).sum(-1)
            lse[rows, cols] = block_lse
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(logits, lse, entropy)
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(logits.shape[0], logits.shape[1], ctx.chunk_size):
            logp = logits[rows, cols].to(lse.dtype) - lse[rows, cols].unsqueeze(-1)
            # dH/dz_j = -p_j (log p_j + H)
            block = -torch.exp(logp) * (logp + entropy[rows, cols].unsqueeze(-1))
            grad[rows, cols] = (block * grad_out[rows, cols].unsqueeze(-1)).to(grad.dtype)
        return grad, None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of the predicted distribution, in chunks of `chunk_size` positions."""
    _check_logits(logits)
    return _Entropy.apply(logits, chunk_size)


def _head_chunk_grad(product: torch.Tensor, lse: torch.Tensor, label: torch.Tensor, temperature: float,
                     grad_out: Optional[torch.Tensor], entropy_grad: Optional[tuple[torch.Tensor, torch.Tensor]]
                     ) -> torch.Tensor:
    """The gradient at one chunk of the head's product z of its log-probs (weights `grad_out`) and entropies
    ((entropy, weights)) at `temperature`, in two fp32 chunk buffers, in place:
    d/dz = (g (onehot - p) - g_H p (log p + H)) / temperature, with log p = z / temperature - lse."""
    logp = product.to(lse.dtype)  # the product is this chunk's own: overwritten in place
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(lse.unsqueeze(-1))
    p = torch.exp(logp)
    if entropy_grad is not None:
        entropy, g_h = entropy_grad
        dz = logp.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-g_h.to(lse.dtype).unsqueeze(-1))
    else:
        dz = logp.zero_()
    if grad_out is not None:
        g = torch.where(label != IGNORE_INDEX, grad_out, 0.0).to(lse.dtype).unsqueeze(-1)
        dz.sub_(p.mul_(g)).scatter_add_(-1, label.clamp(min=0).unsqueeze(-1), g)
    return dz.div_(temperature) if temperature != 1.0 else dz


class _HeadLogprobs(torch.autograd.Function):
    """log softmax((hidden W^T + b) / temperature)[label], and the entropy of that softmax if asked, `chunk`
    positions at a time. Saved for backward: the hidden states and one log-sum-exp (and entropy) per
    position; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, temperature, with_entropy):
        # Autocast is not active in backward: the product's dtype is fixed here and used in both.
        device = hidden.device.type
        mm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        w, b = weight.to(mm), None if bias is None else bias.to(mm)
        dtype = _compute_dtype(mm)
        out = torch.zeros(labels.shape, dtype=dtype, device=hidden.device)
        lse = torch.zeros_like(out)
        entropy = torch.zeros_like(out) if with_entropy else None
        for s in range(0, labels.shape[0], chunk):
            z = F.linear(hidden[s:s + chunk].to(mm), w, b).to(dtype)
            if temperature != 1.0:
                z.div_(temperature)
            out[s:s + chunk], lse[s:s + chunk] = _chunk_logprobs(z, labels[s:s + chunk])
            if with_entropy:  # H = lse - sum p z, one more chunk-sized buffer (p, then p * z in place)
                p = (z - lse[s:s + chunk].unsqueeze(-1)).exp_()
                entropy[s:s + chunk] = lse[s:s + chunk] - p.mul_(z).sum(-1)
                del p
            del z  # before the next chunk's product, not after it
        ctx.chunk, ctx.mm, ctx.temperature = chunk, mm, temperature
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        return out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        mm, chunk, temperature = ctx.mm, ctx.chunk, ctx.temperature
        w, b = weight.to(mm), None if bias is None else bias.to(mm)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_bias else None
        if grad_out is None and grad_entropy is None:
            return grad_hidden, grad_weight, grad_bias, None, None, None, None
        for s in range(0, labels.shape[0], chunk):
            h = hidden[s:s + chunk].to(mm)
            dz = _head_chunk_grad(F.linear(h, w, b), lse[s:s + chunk], labels[s:s + chunk], temperature,
                                  None if grad_out is None else grad_out[s:s + chunk],
                                  None if grad_entropy is None else (entropy[s:s + chunk], grad_entropy[s:s + chunk]))
            if need_hidden:
                grad_hidden[s:s + chunk] = (dz.to(mm) @ w).to(hidden.dtype)
            if need_weight:
                grad_weight += dz.T @ h.to(lse.dtype)
            if need_bias:
                grad_bias += dz.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                  chunk: Optional[int] = None, temperature: float = 1.0,
                  with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(N, H) hidden states, a (V, H) output layer and (N,) labels -> (N,) log p(label) at `temperature`; 0
    where the label is IGNORE_INDEX; with `with_entropy`, also (N,) entropy of each position's softmax.
    Equal to `token_logprobs` (and `entropy_from_logits`) of `F.linear(hidden, weight, bias) / temperature`,
    but neither the (N, V) logits nor their gradient is ever held: `chunk` positions (default:
    `head_chunk_positions`) at a time, in forward and again in backward, at the cost of the output layer's
    product run once more in backward.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"head_logprobs takes (N, H) hidden, (V, H) weight, (N,) labels; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logprobs, entropy = _HeadLogprobs.apply(hidden, weight, bias, labels.long(),
                                            chunk or head_chunk_positions(weight.shape[0]), float(temperature),
                                            with_entropy)
    return (logprobs, entropy) if with_entropy else logprobs
