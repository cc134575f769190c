"""PPO experience: generate with `policy`, then score the same tokens with every other adapter.

All passes run on the ONE shared base: `policy` samples (KV cache on, left-padded prompts), then
under `torch.no_grad` the `reference` log-probs of the response tokens, the `value` adapter's
per-token values and the scorer's score of each response (the `reward` adapter and / or reward
functions, `trainer.rl.rewards`), every pass through `trainer.rl.scoring`. Those passes are ONE routed pass of the base
(`SharedBaseModel.fused`): each base layer runs once for all adapters. The policy's own ("old")
log-probs come from the logits it sampled from (`SampledLogprobs`): no scoring pass needs the policy.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

import torch

from foundation.cli import UsageError
from foundation.stages import POLICY
from profiling.decode import sync
from trainer.rl.rewards import Scorer
from trainer.rl.scoring import next_token_logprobs, rollout_scores

logger = logging.getLogger(__name__)

# How generation runs its decode steps (--decode, `decode_kwargs`): the default, and two GPU options that the
# GPU kit's speed part measures (decode-paths, ppo_compiled).
DECODE_PATHS = ("eager", "static", "compiled")


@dataclass(frozen=True)
class Sampling:
    """How responses are sampled (`generate`'s arguments). temperature 0 is greedy decoding."""

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    decode: str = "eager"  # DECODE_PATHS

    @classmethod
    def of(cls, args) -> "Sampling":
        """The sampling fields of a settings object (`trainer.rl.settings.RolloutArguments`)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probs are taken at: the one sampled with (1 for greedy decoding)."""
        return self.temperature or 1.0

    def generate_kwargs(self) -> dict:
        """`generate`'s sampling arguments: its own draw after temperature, top-k and top-p, with the other
        warpers off whatever the model's generation config says; greedy at temperature 0."""
        if not self.temperature:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": None, "typical_p": 1.0}


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


class SampledLogprobs:
    """The log-prob and entropy of each sampled token under the logits it was sampled from (at the sampling
    temperature, before top-k / top-p masks: what a scoring pass gives), read from the model's own forward.

    A forward hook keeps each step's last-position logits (one rows x vocab tensor at a time) until the
    sampled token arrives; `finish` checks one forward ran per token (not so under ZeRO-3 / FSDP generation,
    which PPO and GRPO refuse). Under `--decode compiled` the hook runs eagerly and copies the logits out
    before a CUDA graph's next replay reuses their memory.
    """

    def __init__(self, causal_lm, temperature: float):
        self.causal_lm, self.temperature = causal_lm, temperature
        self.logprobs: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []
        self._pending: Optional[torch.Tensor] = None
        self._handle = None

    def __enter__(self) -> "SampledLogprobs":
        self._handle = self.causal_lm.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    @torch.compiler.disable
    def _hook(self, module, args, kwargs, output) -> None:
        if self._pending is not None:
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self._take(ids[:, -1])
        self._pending = output.logits[:, -1:].clone()

    def _take(self, tokens: torch.Tensor) -> None:
        logprobs, entropy = next_token_logprobs(self._pending, tokens[:, None], self.temperature, with_entropy=True)
        self.logprobs.append(logprobs)
        self.entropy.append(entropy)
        self._pending = None

    def finish(self, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, R) log-probs and entropy of the (B, R) sampled `responses`."""
        steps = len(self.logprobs) + (self._pending is not None)
        if steps != responses.shape[1]:
            raise RuntimeError(f"generate ran {steps} forwards for {responses.shape[1]} sampled tokens: the old "
                               "log-probs are read from one forward per sampled token (no synced_gpus, no chunked "
                               "prefill)")
        if self._pending is not None:
            self._take(responses[:, -1])
        return torch.cat(self.logprobs, dim=1), torch.cat(self.entropy, dim=1)


def decode_kwargs(decode: str, device: torch.device) -> dict:
    """transformers' `generate` arguments for a decode path. eager: its dynamic KV cache, grown token by token;
    static: a KV cache allocated once at its full length, run eagerly; compiled: the static cache and a
    torch.compile'd decode step (what transformers does by itself on CUDA with a static cache; here on any device,
    CUDA graphs on CUDA). Every path leaves `SampledLogprobs` the logits each token was sampled from."""
    if decode not in DECODE_PATHS:
        raise UsageError(f"--decode {decode!r}: must be one of {', '.join(DECODE_PATHS)}")
    if decode == "eager":
        return {}
    if decode == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True  # transformers' own switch: without it, it compiles on accelerators only
    return {"cache_implementation": "static", "compile_config": config}


@torch.no_grad()
def sample_responses(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling,
                     eos_id: int, pad_id: int, adapter: str = POLICY,
                     with_logprobs: bool = False) -> tuple[torch.Tensor, ...]:
    """Sample under `adapter`. Returns (input_ids, attention_mask, response_mask, ended), and with `with_logprobs` the (B, R)
    log-probs and entropy of the sampled tokens under the logits sampled from (`SampledLogprobs`)."""
    kwargs = dict(max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens,
                  eos_token_id=eos_id, pad_token_id=pad_id, **sampling.generate_kwargs(),
                  **decode_kwargs(sampling.decode, prompt_ids.device))
    recorder = SampledLogprobs(model.causal_lm, sampling.scoring_temperature) if with_logprobs else nullcontext()
    with recorder:
        sequences = model.generate(prompt_ids, prompt_mask, adapter=adapter, **kwargs)
    responses = sequences[:, prompt_ids.shape[1]:]
    sampled = recorder.finish(responses) if with_logprobs else ()
    response_mask, ended = response_mask_after_eos(responses, eos_id, pad_id)
    responses = responses.masked_fill(response_mask == 0, pad_id)
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
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
