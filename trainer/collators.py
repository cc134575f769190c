"""Batches of tokenized examples as padded torch tensors.

Training batches are right-padded (positions stay 0..n-1 for every row, and the last real token is
at `attention_mask.sum(1) - 1`); generation batches are left-padded so every row's next token is
produced at the same, last, position. Collators are small dataclasses so DataLoader workers can
pickle them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from trainer.tokenization import IGNORE_INDEX, PairExample, PromptExample, SFTExample


def padded_length(lengths: Sequence[int], pad_to_multiple_of: Optional[int]) -> int:
    """Longest row, rounded up to a multiple of `pad_to_multiple_of` (tensor-core friendly shapes)."""
    if not lengths:
        raise ValueError("cannot collate an empty batch")
    longest = max(lengths)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return longest


def pad(rows: Sequence[Sequence[int]], value: int, length: int, left: bool = False) -> torch.Tensor:
    """`rows` as one (len(rows), length) long tensor, filled with `value` on the right (or left)."""
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, length - len(row) :] = torch.tensor(row, dtype=torch.long)
            else:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def lm_batch(inputs: Sequence[list[int]], labels: Sequence[list[int]], pad_token_id: int,
             pad_to_multiple_of: Optional[int]) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels (-100 on padding)."""
    length = padded_length([len(r) for r in inputs], pad_to_multiple_of)
    return {
        "input_ids": pad(inputs, pad_token_id, length),
        "attention_mask": pad([[1] * len(r) for r in inputs], 0, length),
        "labels": pad(labels, IGNORE_INDEX, length),
    }


@dataclass
class SFTCollator:
    """SFT batch: right padding with `pad_token_id`; labels -100 on prompt and padding."""

    pad_token_id: int
    pad_to_multiple_of: Optional[int] = None

    def __call__(self, examples: Sequence[SFTExample]) -> dict[str, torch.Tensor]:
        return lm_batch([e.input_ids for e in examples], [e.labels for e in examples],
                        self.pad_token_id, self.pad_to_multiple_of)


@dataclass
class PairCollator:
    """Reward / DPO batch of 2B rows: the B chosen rows first, then the B rejected rows, in the same
    example order, so one forward pass scores both (row i pairs with row i + B)."""

    pad_token_id: int
    pad_to_multiple_of: Optional[int] = None

    def __call__(self, examples: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        completions = [e.chosen_ids for e in examples] + [e.rejected_ids for e in examples]
        prompts = [e.prompt_ids for e in examples] * 2
        inputs = [p + c for p, c in zip(prompts, completions)]
        labels = [[IGNORE_INDEX] * len(p) + c for p, c in zip(prompts, completions)]
        return lm_batch(inputs, labels, self.pad_token_id, self.pad_to_multiple_of)


@dataclass
class PromptCollator:
    """Generation batch: left padding, so every prompt ends at the last column."""

    pad_token_id: int
    pad_to_multiple_of: Optional[int] = None

    def __call__(self, examples: Sequence[PromptExample]) -> dict[str, torch.Tensor]:
        prompts = [e.prompt_ids for e in examples]
        length = padded_length([len(p) for p in prompts], self.pad_to_multiple_of)
        return {
            "input_ids": pad(prompts, self.pad_token_id, length, left=True),
            "attention_mask": pad([[1] * len(p) for p in prompts], 0, length, left=True),
        }
