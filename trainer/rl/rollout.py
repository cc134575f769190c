"""Experience for every online-RL method: sample G responses per prompt with `policy`, then score the same
tokens with every other adapter the method needs.

All passes run on the ONE shared base: `policy` samples (the run's `trainer.model.decode.Generator`),
then under `torch.no_grad` the `reference` log-probs of the response tokens, the `value` adapter's per-token
values (PPO) and the reward adapter's score, as ONE routed pass of the base (`trainer.rl.scoring`: each base
layer runs once for all adapters); reward functions (`trainer.rl.rewards`) add theirs. The policy's own ("old")
log-probs come from the logits it sampled from: no scoring pass needs the policy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

import torch

from foundation.stages import POLICY
from profiling.decode import sync
from trainer.engine.phases import errors_in, phase
from trainer.model.decode import Generator, Sampling
from trainer.rl.rewards import Scorer
from trainer.rl.scoring import rollout_scores

logger = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One batch of experience: `group` responses per prompt, on consecutive rows. Prompts are left-padded to
    `prompt_length`; responses right-padded; every per-token series is 0 after each row's EOS."""

    input_ids: torch.Tensor  # (B, P + R) prompt then response
    attention_mask: torch.Tensor  # (B, P + R)
    response_mask: torch.Tensor  # (B, R) float: 1 on response tokens up to and including EOS
    prompt_length: int
    logprobs: torch.Tensor  # (B, R) policy log-probs when sampled (the "old" policy)
    ref_logprobs: Optional[torch.Tensor]  # (B, R) reference (frozen SFT) log-probs; None without a KL term
    values: Optional[torch.Tensor]  # (B, R) value of the state before each response token; None without a critic
    scores: torch.Tensor  # (B,) score of each whole response: reward adapter + weighted reward functions
    ended: torch.Tensor  # (B,) bool: the response reached EOS
    entropy: torch.Tensor  # (B, R) policy entropy per response position (metrics only)
    group: int = 1  # responses per prompt
    generate_s: float = 0.0  # wall time of the generation (prefill and decode), device synchronised
    reward_metrics: dict = field(default_factory=dict)  # rewards/NAME/mean and /std of each reward function

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def buffers(self) -> list[torch.Tensor]:
        """What the update holds for backward-free reading: the token ids and the per-token series it reads."""
        return [t for t in (self.input_ids, self.logprobs, self.ref_logprobs, self.values) if t is not None]

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
def sample_responses(generator: Generator, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                     eos_id: int, pad_id: int, adapter: str = POLICY,
                     with_logprobs: bool = False) -> tuple[torch.Tensor, ...]:
    """Sample under `adapter`. Returns (input_ids, attention_mask, response_mask, ended), and with
    `with_logprobs` the (B, R) log-probs and entropy of the sampled tokens under the logits sampled from."""
    decoded = generator.sample(prompt_ids, prompt_mask, sampling, eos_id, pad_id, adapter=adapter)
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


def sample_in_chunks(generator: Generator, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, eos_id: int,
                     pad_id: int, rows: int, with_logprobs: bool = False) -> Samples:
    """`sample_responses` over chunks of `rows` prompts, joined: chunks can stop at different lengths, so
    every response (and its sampled log-probs and entropy) is right-padded to the longest."""
    parts = [sample_responses(generator, prompt_ids[i : i + rows], prompt_mask[i : i + rows], sampling, eos_id, pad_id,
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
def make_rollout(generator: Generator, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, args, scorer: Scorer, eos_id: int,
                 pad_id: int, *, group: int = 1, reference: bool = True, value: bool = False,
                 nan_unscored: bool = False, examples: Optional[Sequence] = None) -> Rollout:
    """Sample `group` responses per prompt with `generator`, then score them on its model, `generator.rows` rows at a
    time (`args`: the rollout settings, `trainer.rl.settings.RolloutArguments`: sampling, the missing-EOS
    penalty). `reference` / `value`: whether the scoring pass reads those adapters. `examples` are
    the prompts' dataset rows, whose columns the reward functions read; a response no function scored is 0, or
    NaN with `nan_unscored`.

    The policy's log-probs and entropy are read from the logits it sampled from (phase "generate"); the
    reference, value and reward passes run as ONE routed pass of the base per micro-batch (phase "score").
    """
    model = generator.model
    was_training = model.training
    model.eval()  # no dropout: these log-probs and values are the fixed "old" ones of the update
    try:
        return _make_rollout(generator, prompt_ids.repeat_interleave(group, dim=0),
                             prompt_mask.repeat_interleave(group, dim=0), args, scorer, eos_id, pad_id, group,
                             reference, value, nan_unscored,
                             None if examples is None else [e for e in examples for _ in range(group)])
    finally:
        model.train(was_training)


def _make_rollout(generator: Generator, prompt_ids, prompt_mask, args, scorer, eos_id, pad_id, group, reference,
                  value, nan_unscored, examples) -> Rollout:
    model, sampling = generator.model, Sampling.of(args)
    batch, prompt_length = prompt_ids.shape[0], prompt_ids.shape[1]
    rows = generator.pass_rows(batch)
    # One copy of the generation weights for every chunk, made before the phase's entry count: the memory
    # record shows it as its own component, not inside the KV cache's transient peak.
    with errors_in("generate"), generator.holding(), phase("generate"):
        sync(prompt_ids.device)
        started = time.perf_counter()
        samples = sample_in_chunks(generator, prompt_ids, prompt_mask, sampling, eos_id, pad_id, rows, with_logprobs=True)
        sync(prompt_ids.device)
        generate_s = time.perf_counter() - started
    input_ids, attention_mask, response_mask = samples.input_ids, samples.attention_mask, samples.response_mask
    with phase("score"):  # nothing to pass when neither reference, value nor reward adapter is asked for
        ref_logprobs, values, adapter_scores = chunked(
            lambda i, m, r: rollout_scores(model, i, m, r, sampling.scoring_temperature, reference=reference,
                                           value=value, reward_adapter=scorer.adapter),
            rows, batch, input_ids, attention_mask, response_mask)
        scores, reward_metrics = scorer.score(model, input_ids, attention_mask, prompt_length, response_mask,
                                              examples, adapter_scores, nan_unscored=nan_unscored)
    if args.missing_eos_penalty is not None:
        scores = torch.where(samples.ended, scores, scores - args.missing_eos_penalty)
    fmask = response_mask.float()
    return Rollout(input_ids=input_ids, attention_mask=attention_mask, response_mask=fmask,
                   prompt_length=prompt_length, logprobs=samples.logprobs * fmask,
                   ref_logprobs=None if ref_logprobs is None else ref_logprobs * fmask,
                   values=None if values is None else values.float() * fmask, scores=scores.float(),
                   ended=samples.ended, entropy=samples.entropy * fmask, group=group, generate_s=generate_s,
                   reward_metrics=reward_metrics)


def _pad_right(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
