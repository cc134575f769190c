"""Batches of tokenized examples as padded torch tensors.

Training batches are right-padded (positions stay 0..n-1 for every row, and the last real token is
at `attention_mask.sum(1) - 1`); generation batches are left-padded so every row's next token is
produced at the same, last, position. Collators are small dataclasses so DataLoader workers can
pickle them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from trainer.data.tokenization import IGNORE_INDEX, PairExample, PromptExample, SFTExample

logger = logging.getLogger(__name__)


def pad(rows: Sequence[Sequence[int]], value: int, left: bool = False) -> torch.Tensor:
    """`rows` as one (len(rows), longest) long tensor, filled with `value` on the right (or left)."""
    if not rows:
        raise ValueError("cannot collate an empty batch")
    length = max(len(r) for r in rows)
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, length - len(row) :] = torch.tensor(row, dtype=torch.long)
            else:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def lm_batch(inputs: Sequence[list[int]], labels: Sequence[list[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels (-100 on padding)."""
    return {
        "input_ids": pad(inputs, pad_token_id),
        "attention_mask": pad([[1] * len(r) for r in inputs], 0),
        "labels": pad(labels, IGNORE_INDEX),
    }


@dataclass
class SFTCollator:
    """SFT batch: right padding with `pad_token_id`; labels -100 on prompt and padding."""

    pad_token_id: int

    def __call__(self, examples: Sequence[SFTExample]) -> dict[str, torch.Tensor]:
        return lm_batch([e.input_ids for e in examples], [e.labels for e in examples], self.pad_token_id)


@dataclass
class PairCollator:
    """Reward / DPO batch of 2B rows: the B chosen rows first, then the B rejected rows, in the same
    example order, so one forward pass scores both (row i pairs with row i + B)."""

    pad_token_id: int

    def __call__(self, examples: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        completions = [e.chosen_ids for e in examples] + [e.rejected_ids for e in examples]
        prompts = [e.prompt_ids for e in examples] * 2
        inputs = [p + c for p, c in zip(prompts, completions)]
        labels = [[IGNORE_INDEX] * len(p) + c for p, c in zip(prompts, completions)]
        return lm_batch(inputs, labels, self.pad_token_id)


@dataclass
class SharedPromptPairCollator:
    """Reward / DPO batch of B rows, ONE per pair: prompt, chosen, rejected, the prompt's tokens computed once.

    `segments` marks each token: 0 prompt, 1 chosen, 2 rejected, -1 padding. The model's pair mask lets a
    completion token see the prompt and its own completion's earlier tokens only, and both completions'
    positions continue the prompt's, so each is scored exactly as in a row of its own (`PairCollator`)
    while the prompt, usually most of an hh-rlhf row, runs once instead of twice. Labels are the
    completion tokens (-100 on prompt and padding)."""

    pad_token_id: int

    def __call__(self, examples: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        inputs = [e.prompt_ids + e.chosen_ids + e.rejected_ids for e in examples]
        labels = [[IGNORE_INDEX] * len(e.prompt_ids) + e.chosen_ids + e.rejected_ids for e in examples]
        segments = [[0] * len(e.prompt_ids) + [1] * len(e.chosen_ids) + [2] * len(e.rejected_ids) for e in examples]
        batch = lm_batch(inputs, labels, self.pad_token_id)
        batch["segments"] = pad(segments, -1)
        return batch


def pairs_in(batch: dict[str, torch.Tensor]) -> int:
    """Pairs in a batch of either layout: one row each (`segments`), or a chosen and a rejected row each."""
    rows = batch["input_ids"].shape[0]
    return rows if "segments" in batch else rows // 2


def pair_collator(pad_token_id: int, share_prompt: bool, model) -> "PairCollator | SharedPromptPairCollator":
    """The reward / DPO batch layout: one row per pair (`share_prompt`, where `model` takes the pair mask), else
    chosen rows over rejected rows, with one line saying why."""
    if share_prompt:
        if model.shares_pair_prompts:
            return SharedPromptPairCollator(pad_token_id)
        logger.info("share_pair_prompts: this attention implementation takes no custom mask (use sdpa or eager); "
                    "chosen and rejected run as rows of their own")
    return PairCollator(pad_token_id)


@dataclass
class PromptCollator:
    """Generation batch: left padding, so every prompt ends at the last column; `examples` are the rows
    themselves, whose columns the reward functions read."""

    pad_token_id: int

    def __call__(self, examples: Sequence[PromptExample]) -> dict:
        prompts = [e.prompt_ids for e in examples]
        return {
            "input_ids": pad(prompts, self.pad_token_id, left=True),
            "attention_mask": pad([[1] * len(p) for p in prompts], 0, left=True),
            "examples": list(examples),
        }
