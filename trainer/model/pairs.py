"""One row per preference pair: prompt, chosen, rejected, the prompt computed once.

`SharedPromptPairCollator` lays a pair out as one row with `segments` (0 prompt, 1 chosen, 2 rejected,
-1 padding). These pure functions make the base model score each completion as if it sat alone after
the prompt: `pair_attention_mask` (a token sees the prompt and its own segment), `pair_positions` (both
completions continue the prompt's positions) and `predicting_positions` (the first rejected token is
predicted from the last prompt token). Tested against separate rows in tests/test_shared_base.py.
"""

from __future__ import annotations

from typing import Optional

import torch

PROMPT, CHOSEN, REJECTED, PADDING = 0, 1, 2, -1
MASK_IMPLEMENTATIONS = ("sdpa", "eager")  # attention that takes a custom 4D mask (flash-attention does not)


def pair_attention_mask(segments: torch.Tensor, dtype: torch.dtype, additive: bool,
                        window: Optional[int] = None) -> torch.Tensor:
    """(B, 1, T, T) mask: boolean (True: attend; for SDPA) or additive (0 / dtype min; for eager attention).
    `window`: a sliding-window layer's, counted in positions (`pair_positions`), as in a row of its own.

    Padding queries attend to themselves only, so no row of the softmax is empty (their outputs are unused)."""
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    q, k = segments[:, :, None], segments[:, None, :]
    allowed = causal & (k != PADDING) & ((k == PROMPT) | (k == q)) & (q != PADDING)
    if window is not None:
        positions = pair_positions(segments)
        allowed &= positions[:, :, None] - positions[:, None, :] < window
    allowed |= torch.eye(t, dtype=torch.bool, device=segments.device)
    allowed = allowed[:, None]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


def _ranks(segments: torch.Tensor, which: int) -> torch.Tensor:
    """Each token's index within its segment `which` (meaningless elsewhere)."""
    return (segments == which).long().cumsum(dim=1) - 1


def pair_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids: the prompt 0..P-1, then each completion from P (padding 0)."""
    prompt_len = (segments == PROMPT).sum(dim=1, keepdim=True)
    positions = torch.zeros_like(segments, dtype=torch.long)
    positions = torch.where(segments == PROMPT, _ranks(segments, PROMPT), positions)
    positions = torch.where(segments == CHOSEN, prompt_len + _ranks(segments, CHOSEN), positions)
    return torch.where(segments == REJECTED, prompt_len + _ranks(segments, REJECTED), positions)


def predicting_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) the index whose output predicts each token: t - 1, but the last prompt token for the first
    rejected token (position 0 points at itself; only completion tokens are ever read)."""
    index = (torch.arange(segments.shape[1], device=segments.device) - 1).clamp(min=0).expand_as(segments).clone()
    last_prompt = (segments == PROMPT).sum(dim=1, keepdim=True) - 1
    first_rejected = (segments == REJECTED) & (_ranks(segments, REJECTED) == 0)
    return torch.where(first_rejected, last_prompt.expand_as(index), index)


def last_of(segments: torch.Tensor, which: int) -> torch.Tensor:
    """(B,) the index of each row's last token of segment `which` (EOS of that completion); for an empty
    completion, the last prompt token's, as a row of the prompt alone would be read (never column -1)."""
    positions = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    return torch.where((segments == which) | (segments == PROMPT), positions, -1).max(dim=1).values
