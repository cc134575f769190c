"""Token ids for SFT, reward / DPO pairs and PPO prompts, with truncation that keeps completions whole.

An example is the prompt's tokens (special tokens added) then the completion's plus EOS; the loss sees only
the completion. Too long, the prompt loses tokens from its left (a leading BOS stays): the completion is what
is trained, the end of the prompt what it answers. A row left with under `min_prompt_tokens` prompt tokens is
a bad row ("too long"). Not named `tokenize`: that would shadow the standard library module.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from foundation.settings import DataArguments
from trainer.data.hh_rlhf import (
    NO_COMPLETION, NO_PROMPT, NO_REJECTED, TOO_LONG, DataError, PreferencePair, apply_policy,
)

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label value that torch's cross-entropy skips
ENCODE_CHUNK = 1024  # texts per batched tokenizer call: fast, and bounded memory on big datasets


@dataclass(frozen=True)
class SFTExample:
    """A prompt and its chosen completion (ending in EOS); the loss sees only the completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    source: str

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def labels(self) -> list[int]:
        return [IGNORE_INDEX] * len(self.prompt_ids) + self.completion_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class PairExample:
    """Chosen and rejected completions (each ending in EOS) after the same prompt ids."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str

    @property
    def length(self) -> int:
        """Tokens of the longer of the two rows."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


@dataclass(frozen=True)
class PromptExample:
    """A PPO prompt, left-truncated to `max_prompt_length`, and its row's columns for the reward functions
    (`prompt`: as the row gave it, text or messages; then any other, e.g. `answer`)."""

    prompt_ids: list[int]
    source: str
    columns: dict = field(default_factory=dict, compare=False)

    @property
    def length(self) -> int:
        return len(self.prompt_ids)


@dataclass
class TokenizeReport:
    """Rows in, examples out, prompts left-truncated, and rows dropped as too long."""

    kind: str
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    too_long: int = 0
    no_rejected: int = 0
    no_prompt: int = 0
    no_completion: int = 0

    def summary(self) -> str:
        unpaired = f", {self.no_rejected} without a rejected completion" if self.no_rejected else ""
        unpaired += f", {self.no_prompt} without a prompt" if self.no_prompt else ""
        unpaired += f", {self.no_completion} without a completion" if self.no_completion else ""
        return (f"tokenized {self.rows} {self.kind} rows: kept {self.kept}, "
                f"{self.truncated} prompts left-truncated, {self.too_long} too long{unpaired}")


def check_tokenizer(tokenizer) -> None:
    """Every example ends in EOS, so a tokenizer without one cannot be used."""
    if tokenizer.eos_token_id is None:
        raise DataError("tokenizer", "no_eos", f"{type(tokenizer).__name__} has no eos_token_id; set "
                        "tokenizer.eos_token first")


def encode(tokenizer, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of `texts` through batched (fast-tokenizer) calls."""
    ids: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = list(texts[start : start + ENCODE_CHUNK])
        # verbose=False: rows longer than model_max_length are expected here; truncation is ours.
        ids.extend(tokenizer(chunk, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])
    return ids


def fit_prompt(prompt_ids: list[int], budget: int, min_prompt_tokens: int, bos_id: Optional[int]) -> Optional[list[int]]:
    """`prompt_ids` cut from the left to at most `budget` tokens, a leading BOS kept.

    None when the budget is below `min_prompt_tokens` (the row is too long to keep).
    """
    if len(prompt_ids) <= budget:
        return prompt_ids
    if budget < min_prompt_tokens:
        return None
    keep_bos = bos_id is not None and prompt_ids[0] == bos_id
    head = prompt_ids[:1] if keep_bos else []
    tail = budget - len(head)
    return head + prompt_ids[len(prompt_ids) - tail :]


def with_eos(ids_list: list[list[int]], eos_id: int) -> list[list[int]]:
    return [ids + [eos_id] for ids in ids_list]


def reject_too_long(pair: PreferencePair, completion_len: int, args: DataArguments, skipped: Counter) -> None:
    detail = (f"a completion of {completion_len} tokens leaves fewer than min_prompt_tokens="
              f"{args.min_prompt_tokens} prompt tokens within max_length={args.max_length}")
    apply_policy(DataError(pair.source, TOO_LONG, detail), args.on_bad_row, skipped)


def log_report(report: TokenizeReport, skipped: Counter) -> TokenizeReport:
    report.too_long, report.no_rejected, report.no_prompt = skipped[TOO_LONG], skipped[NO_REJECTED], skipped[NO_PROMPT]
    report.no_completion = skipped[NO_COMPLETION]
    dropped = report.too_long + report.no_rejected + report.no_prompt + report.no_completion
    level = logging.WARNING if dropped else logging.INFO
    logger.log(level, "%s", report.summary())
    return report


def with_completions(pairs: Sequence[PreferencePair], args: DataArguments, skipped: Counter) -> list[PreferencePair]:
    """`pairs` less the prompt-only rows, each a bad row here (`no_completion`)."""
    for pair in pairs:
        if pair.chosen is None:
            apply_policy(DataError(pair.source, NO_COMPLETION, "a prompt-only row has no completion to train on "
                                   "(PPO and GRPO read such rows)"), args.on_bad_row, skipped)
    return [p for p in pairs if p.chosen is not None]


def tokenize_sft(pairs: Sequence[PreferencePair], tokenizer, args: DataArguments) -> tuple[list[SFTExample], TokenizeReport]:
    """SFT examples (prompt + chosen completion + EOS) within `args.max_length`."""
    check_tokenizer(tokenizer)
    report, skipped, examples = TokenizeReport("sft", rows=len(pairs)), Counter(), []
    pairs = with_completions(pairs, args, skipped)
    prompts = encode(tokenizer, [p.prompt for p in pairs], add_special_tokens=True)
    completions = with_eos(encode(tokenizer, [p.chosen for p in pairs], add_special_tokens=False), tokenizer.eos_token_id)
    for pair, prompt_ids, completion_ids in zip(pairs, prompts, completions):
        if not pair.prompt:  # a text row: the loss covers all of it, cut at max_length (EOS kept last)
            room = args.max_length - len(prompt_ids)
            if len(completion_ids) > room:
                completion_ids = completion_ids[: room - 1] + completion_ids[-1:]
                report.truncated += 1
            examples.append(SFTExample(prompt_ids, completion_ids, pair.source))
            continue
        fitted = fit_prompt(prompt_ids, args.max_length - len(completion_ids), args.min_prompt_tokens,
                            tokenizer.bos_token_id)
        if fitted is None:
            reject_too_long(pair, len(completion_ids), args, skipped)
            continue
        report.truncated += len(fitted) < len(prompt_ids)
        examples.append(SFTExample(fitted, completion_ids, pair.source))
    report.kept = len(examples)
    return examples, log_report(report, skipped)


def tokenize_pairs(pairs: Sequence[PreferencePair], tokenizer, args: DataArguments) -> tuple[list[PairExample], TokenizeReport]:
    """Reward / DPO examples: both completions after one prompt, budgeted by the longer completion."""
    check_tokenizer(tokenizer)
    eos = tokenizer.eos_token_id
    report, skipped, examples = TokenizeReport("pair", rows=len(pairs)), Counter(), []
    pairs = with_completions(pairs, args, skipped)
    for pair in pairs:
        if pair.rejected is None:  # a prompt/completion row: SFT and PPO read it, a pairwise loss cannot
            apply_policy(DataError(pair.source, NO_REJECTED, "a prompt/completion row has no 'rejected' completion "
                                   "for a pairwise loss"), args.on_bad_row, skipped)
    pairs = [p for p in pairs if p.rejected is not None]
    prompts = encode(tokenizer, [p.prompt for p in pairs], add_special_tokens=True)
    chosen = with_eos(encode(tokenizer, [p.chosen for p in pairs], add_special_tokens=False), eos)
    rejected = with_eos(encode(tokenizer, [p.rejected for p in pairs], add_special_tokens=False), eos)
    for pair, prompt_ids, chosen_ids, rejected_ids in zip(pairs, prompts, chosen, rejected):
        longest = max(len(chosen_ids), len(rejected_ids))
        fitted = fit_prompt(prompt_ids, args.max_length - longest, args.min_prompt_tokens, tokenizer.bos_token_id)
        if fitted is None:
            reject_too_long(pair, longest, args, skipped)
            continue
        report.truncated += len(fitted) < len(prompt_ids)
        examples.append(PairExample(fitted, chosen_ids, rejected_ids, pair.source))
    report.kept = len(examples)
    return examples, log_report(report, skipped)


def tokenize_prompts(pairs: Sequence[PreferencePair], tokenizer, args: DataArguments) -> tuple[list[PromptExample], TokenizeReport]:
    """PPO prompts, left-truncated to `args.max_prompt_length` (a leading BOS kept); text rows, which have no
    prompt, are bad rows here (`no_prompt`)."""
    skipped = Counter()
    for pair in pairs:
        if not pair.prompt:
            apply_policy(DataError(pair.source, NO_PROMPT, "a text row has no prompt to generate from"),
                         args.on_bad_row, skipped)
    rows, pairs = len(pairs), [p for p in pairs if p.prompt]
    prompts = encode(tokenizer, [p.prompt for p in pairs], add_special_tokens=True)
    report, examples = TokenizeReport("prompt", rows=rows), []
    for pair, prompt_ids in zip(pairs, prompts):
        fitted = fit_prompt(prompt_ids, args.max_prompt_length, 1, tokenizer.bos_token_id)
        report.truncated += len(fitted) < len(prompt_ids)
        examples.append(PromptExample(fitted, pair.source, {"prompt": pair.prompt, **pair.columns}))
    report.kept = len(examples)
    return examples, log_report(report, skipped)


@dataclass(frozen=True)
class PackedExample:
    """Several SFT examples concatenated into one row; labels keep each one's prompt masked.

    Rows attend across the examples they hold (no per-example attention reset): the usual packing
    trade-off, taken for fewer padding tokens per batch.
    """

    input_ids: list[int]
    labels: list[int]
    source: str

    @property
    def length(self) -> int:
        return len(self.input_ids)


def pack_sft(examples: Sequence[SFTExample], max_length: int) -> list[PackedExample]:
    """Greedy in-order packing of SFT examples into rows of at most `max_length` tokens."""
    packed: list[PackedExample] = []
    ids: list[int] = []
    labels: list[int] = []
    sources: list[str] = []
    for ex in examples:
        if ids and len(ids) + len(ex.input_ids) > max_length:
            packed.append(PackedExample(ids, labels, "+".join(sources)))
            ids, labels, sources = [], [], []
        ids, labels = ids + ex.input_ids, labels + ex.labels
        sources.append(ex.source)
    if ids:
        packed.append(PackedExample(ids, labels, "+".join(sources)))
    logger.info("packed %d SFT examples into %d rows of <= %d tokens", len(examples), len(packed), max_length)
    return packed
