"""PPO experience: generate with `policy`, then score the same tokens with every other adapter.

All passes run on the ONE shared base: `policy` samples (KV cache on, left-padded prompts), then
under `torch.no_grad` the `reference` log-probs of the response tokens, the `value` adapter's
per-token values and the scorer's score of each response (the `reward` adapter and / or reward
functions, `trainer.rl.rewards`), every pass through `trainer.rl.scoring`. Those passes are ONE routed pass of the base
(`SharedBaseModel.fused`): each base layer runs once for all adapters. The policy's own ("old")
log-probs come from the logits it sampled from (`trainer.model.decode`): no scoring pass needs the policy.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

import torch

from foundation.stages import POLICY
from profiling.decode import sync
from trainer.model.decode import Sampling, decode
from trainer.rl.rewards import Scorer
from trainer.rl.scoring import rollout_scores

logger = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One batch of experience. Prompts are left-padded to `prompt_length`; responses right-padded."""

    input_ids: torch.Tensor  # (B, P + R) prompt then response
    attention_mask: torch.Tensor  # (B, P + R)
    response_mask: torch.Tensor  # (B, R) 1 on response tokens up to and including EOS
    prompt_length: int
    logprobs: torch.Tensor  # (B, R) policy log-probs when sampled (the "old" policy)
    ref_logprobs: torch.Tensor  # (B, R) reference (frozen SFT) log-probs
    values: torch.Tensor  # (B, R) value of the state before each response token
    scores: torch.Tensor  # (B,) score of each whole response: reward adapter + weighted reward functions
    ended: torch.Tensor  # (B,) bool: the response reached EOS
    entropy: torch.Tensor  # (B, R) policy entropy per response position (metrics only)
    generate_s: float = 0.0  # wall time of the generation (prefill and decode), device synchronised
    reward_metrics: dict = field(default_factory=dict)  # rewards/NAME/mean and /std of each reward function

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def select(self, index: torch.Tensor) -> "Rollout":
        """Rows `index` of every per-row tensor (minibatching)."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in picked.items():
            if isinstance(value, torch.Tensor):
                picked[name] = value[index]
        return Rollout(**picked)


def response_mask_after_eos(responses: torch.Tensor, eos_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) sampled tokens -> (mask with 1 up to and including the first EOS, ended flags).

    Generation keeps emitting pad after a row finishes; with pad == eos (common) only the FIRST eos
    is part of the response.
    """
    is_eos = responses == eos_id
    ended = is_eos.any(dim=1)
    no_eos = torch.full_like(ended, responses.shape[1], dtype=torch.long)
    first_eos = torch.where(ended, is_eos.float().argmax(dim=1), no_eos)
    positions = torch.arange(responses.shape[1], device=responses.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ended


@torch.no_grad()
def sample_responses(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                     eos_id: int, pad_id: int, adapter: str = POLICY,
                     with_logprobs: bool = False) -> tuple[torch.Tensor, ...]:
    """Sample under `adapter` (`trainer.model.decode`). Returns (input_ids, attention_mask, response_mask, ended),
    and with `with_logprobs` the (B, R) log-probs and entropy of the sampled tokens under the logits sampled from."""
    decoded = decode(model, prompt_ids, prompt_mask, sampling, eos_id, pad_id, adapter=adapter)
    response_mask, ended = response_mask_after_eos(decoded.tokens, eos_id, pad_id)
    responses = decoded.tokens.masked_fill(response_mask == 0, pad_id)
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    sampled = (decoded.logprobs, decoded.entropy) if with_logprobs else ()
    return (input_ids, attention_mask, response_mask, ended, *sampled)


@dataclass
class Samples:
    """Sampled rows of a whole batch: prompt (left-padded) then response (right-padded to the longest)."""

    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    response_mask: torch.Tensor  # (B, R) 1 up to and including the first EOS
    ended: torch.Tensor  # (B,) bool
    logprobs: Optional[torch.Tensor] = None  # (B, R) with `with_logprobs`; 0 past each micro-batch's end
    entropy: Optional[torch.Tensor] = None  # (B, R) likewise


def sample_in_chunks(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, eos_id: int,
                     pad_id: int, rows: int, with_logprobs: bool = False) -> Samples:
    """`sample_responses` over chunks of `rows` prompts, joined: chunks can stop at different lengths, so
    every response (and its sampled log-probs and entropy) is right-padded to the longest."""
    parts = [sample_responses(model, prompt_ids[i : i + rows], prompt_mask[i : i + rows], sampling, eos_id, pad_id,
                              with_logprobs=with_logprobs) for i in range(0, prompt_ids.shape[0], rows)]
    width = max(p[0].shape[1] for p in parts)
    response_width = width - prompt_ids.shape[1]

    def joined(k: int, pad_width: int, value: int) -> torch.Tensor:
        return torch.cat([_pad_right(p[k], pad_width, value) for p in parts])

    extra = (joined(4, response_width, 0), joined(5, response_width, 0)) if with_logprobs else ()
    return Samples(joined(0, width, pad_id), joined(1, width, 0), joined(2, response_width, 0),
                   torch.cat([p[3] for p in parts]), *extra)


def chunked(fn: Callable, size: int, batch: int, *tensors: torch.Tensor):
    """Apply `fn` to row chunks of `tensors` and concatenate its (tuple of) outputs."""
    outs = [fn(*(t[i : i + size] for t in tensors)) for i in range(0, batch, size)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) if parts[0] is not None else None for parts in zip(*outs))
    return torch.cat(outs)


@torch.no_grad()
def make_rollout(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, args, scorer: Scorer, eos_id: int,
                 pad_id: int, phase=None, examples: Optional[Sequence] = None) -> Rollout:
    """Generate, then score with reference / value / reward, `args.rollout_micro_batch_size` rows at a time
    (`args`: the rollout settings, `trainer.rl.settings.RolloutArguments`: sampling, rows per pass, the
    missing-EOS penalty). `examples` are the prompts' dataset rows, whose columns the reward functions read.

    The policy's log-probs and entropy are read from the logits it sampled from (phase "generate"); the
    reference, value and reward passes run as ONE routed pass of the base per micro-batch (phase "score").
    `phase` is an optional context-manager factory (`phase("generate")`): the memory recorder's, or a
    benchmark's clock.
    """
    phase = phase or (lambda name: nullcontext())
    was_training = model.training
    model.eval()  # no dropout: these log-probs and values are the fixed "old" ones of the update
    try:
        return _make_rollout(model, prompt_ids, prompt_mask, args, scorer, eos_id, pad_id, phase, examples)
    finally:
        model.train(was_training)


def _make_rollout(model, prompt_ids, prompt_mask, args, scorer, eos_id, pad_id, phase, examples) -> Rollout:
    sampling, rows = Sampling.of(args), args.rollout_micro_batch_size
    batch, prompt_length = prompt_ids.shape[0], prompt_ids.shape[1]
    with phase("generate"):
        sync(prompt_ids.device)
        started = time.perf_counter()
        samples = sample_in_chunks(model, prompt_ids, prompt_mask, sampling, eos_id, pad_id, rows, with_logprobs=True)
        sync(prompt_ids.device)
        generate_s = time.perf_counter() - started
    input_ids, attention_mask, response_mask = samples.input_ids, samples.attention_mask, samples.response_mask
    with phase("score"):
        ref_logprobs, values, adapter_scores = chunked(
            lambda i, m, r: rollout_scores(model, i, m, r, sampling.scoring_temperature, reference=True, value=True,
                                           reward_adapter=scorer.adapter),
            rows, batch, input_ids, attention_mask, response_mask)
        scores, reward_metrics = scorer.score(model, input_ids, attention_mask, prompt_length, response_mask,
                                              examples, adapter_scores)
    return _finish(samples, prompt_length, ref_logprobs, values, scores, args.missing_eos_penalty, generate_s,
                   reward_metrics)


def _finish(samples: Samples, prompt_length: int, ref_logprobs, values, scores, missing_eos_penalty,
            generate_s, reward_metrics: dict) -> Rollout:
    """The rollout with the missing-EOS penalty applied and every per-token tensor 0 after each row's EOS."""
    ended, response_mask = samples.ended, samples.response_mask
    if missing_eos_penalty is not None:
        scores = torch.where(ended, scores, scores - missing_eos_penalty)
    fmask = response_mask.float()
    return Rollout(input_ids=samples.input_ids, attention_mask=samples.attention_mask, response_mask=fmask,
                   prompt_length=prompt_length, logprobs=samples.logprobs * fmask, ref_logprobs=ref_logprobs * fmask,
                   values=values.float() * fmask, scores=scores.float(), ended=ended,
                   entropy=samples.entropy * fmask, generate_s=generate_s, reward_metrics=reward_metrics)


def _pad_right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
