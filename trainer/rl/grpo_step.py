"""One critic-free step (GRPO or RLOO) on the shared base: PPO's plumbing less the value model.

    prompts x num_generations -> generate (old log-probs read while sampling) -> one routed pass for the
    reference's log-probs and the reward's score -> advantages per prompt group -> clipped ratio loss
    (+ beta * k3 to the reference for GRPO; RLOO puts the KL in the reward, as TRL's RLOOTrainer does)

beta 0 skips the reference pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from foundation.stages import POLICY
from trainer.engine.harness import Engine, StepResult
from trainer.losses import group_advantages, group_mean_std, grpo_policy_loss, kl_penalty
from trainer.rl.rollout import Sampling, chunked, sample_in_chunks
from trainer.rl.scoring import response_logprobs, rollout_scores, trimmed_to_longest_response
from trainer.rl.update import Update, run_update


@dataclass
class GroupRollout:
    input_ids: torch.Tensor  # (P*G, P_len + R): each prompt's G responses are consecutive rows
    attention_mask: torch.Tensor
    response_mask: torch.Tensor  # (P*G, R) float
    logprobs: torch.Tensor  # (P*G, R) old policy log-probs
    ref_logprobs: Optional[torch.Tensor]  # (P*G, R), None when beta is 0
    scores: torch.Tensor  # (P*G,)
    ended: torch.Tensor  # (P*G,) bool
    generate_s: float
    reward_metrics: dict = field(default_factory=dict)  # rewards/NAME/mean and /std of each reward function


@dataclass
class GroupState:
    """What a critic-free run carries between steps (checkpointed): the minibatch order and the update's
    micro-batch (halved after an out-of-memory error)."""

    generator: torch.Generator
    micro_batch_size: int

    def state_dict(self) -> dict:
        return {"minibatch_rng": self.generator.get_state().tolist(), "update_micro_batch": self.micro_batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(torch.tensor(state["minibatch_rng"], dtype=torch.uint8))
        self.micro_batch_size = state.get("update_micro_batch", self.micro_batch_size)


@torch.no_grad()
def group_rollout(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, args, scorer, eos_id: int,
                  pad_id: int, phase: Callable, examples: Optional[Sequence] = None) -> GroupRollout:
    """Generate `num_generations` responses per prompt and score them in one routed pass per chunk; each
    prompt's dataset row (`examples`) goes with each of its responses to the reward functions."""
    sampling, rows = Sampling.of(args), args.rollout_micro_batch_size
    ids = prompt_ids.repeat_interleave(args.num_generations, dim=0)
    mask = prompt_mask.repeat_interleave(args.num_generations, dim=0)
    if examples is not None:
        examples = [e for e in examples for _ in range(args.num_generations)]
    was_training = model.training
    model.eval()
    try:
        with phase("generate"):
            started = time.perf_counter()
            samples = sample_in_chunks(model, ids, mask, sampling, eos_id, pad_id, rows, with_logprobs=True)
            generate_s = time.perf_counter() - started
        input_ids, attention_mask, response_mask, ended = (samples.input_ids, samples.attention_mask,
                                                           samples.response_mask, samples.ended)
        temperature = sampling.scoring_temperature
        with phase("score"):
            # nothing to score when beta is 0 and no reward adapter is set: both None
            ref, _, adapter_scores = chunked(
                lambda i, m, r: rollout_scores(model, i, m, r, temperature, reference=args.beta > 0, value=False,
                                               reward_adapter=scorer.adapter),
                rows, input_ids.shape[0], input_ids, attention_mask, response_mask)
            scores, reward_metrics = scorer.score(model, input_ids, attention_mask, ids.shape[1], response_mask,
                                                  examples, adapter_scores, nan_unscored=True)
    finally:
        model.train(was_training)
    if args.missing_eos_penalty is not None:
        scores = torch.where(ended, scores, scores - args.missing_eos_penalty)
    fmask = response_mask.float()
    # the sampled log-probs: steps after a row's EOS are masked out here
    return GroupRollout(input_ids, attention_mask, fmask, samples.logprobs * fmask, None if ref is None else ref * fmask,
                        scores.float(), ended, generate_s, reward_metrics)


def rollout_advantages(rollout: GroupRollout, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (P*G,), the rewards they came from (P*G,)): RLOO folds -beta * KL into the reward."""
    rewards = rollout.scores
    if args.advantage == "rloo" and args.beta > 0:
        kl = (kl_penalty(rollout.logprobs, rollout.ref_logprobs, "k1") * rollout.response_mask).sum(1)
        rewards = rewards - args.beta * kl
    groups = rewards.view(-1, args.num_generations)
    return group_advantages(groups, args.advantage, args.scale_rewards).flatten(), rewards


def grpo_step(engine: Engine, batch: dict[str, torch.Tensor], args, state: GroupState, scorer, eos_id: int,
              pad_id: int, phase: Optional[Callable] = None) -> StepResult:
    """Rollout -> group advantages -> `epochs` passes of clipped-ratio minibatch updates (`args`: GRPOArguments)."""
    acc, raw = engine.accelerator, engine.raw
    phase = phase or engine.recorder.phase
    started = time.perf_counter()
    rollout = group_rollout(raw, batch["input_ids"].to(acc.device), batch["attention_mask"].to(acc.device), args,
                            scorer, eos_id, pad_id, phase, batch.get("examples"))
    advantages, rewards = rollout_advantages(rollout, args)
    rollout_s = time.perf_counter() - started
    engine.model.train()
    temperature = Sampling.of(args).scoring_temperature
    started = time.perf_counter()
    size = rollout.input_ids.shape[0]
    update = Update("GRPO", args.epochs, args.mini_batch_size,
                    loss_of=lambda idx: _micro_loss(engine.model, rollout, advantages, idx, args, temperature),
                    count_of=lambda idx: _loss_units(rollout, idx, args.loss_normalisation), grad_norm_key="grad_norm")
    with phase("update"):
        metrics, all_finite, any_stepped = run_update(engine, state, update, size)
    update_s = time.perf_counter() - started
    # each prompt's spread of scores; a NaN score (a response no reward function scored) is left out
    spread = group_mean_std(rollout.scores.view(-1, args.num_generations))[2]
    metrics.update({
        "reward": _nan_mean(rewards), "reward_std": _nan_mean(spread) if args.num_generations > 1 else 0.0,
        "objective/scores": _nan_mean(rollout.scores),
        "frac_reward_unscored": rollout.scores.isnan().float().mean().item(),
        "completions/mean_length": rollout.response_mask.sum(1).mean().item(),
        "completions/clipped_ratio": (~rollout.ended).float().mean().item(),
        "frac_reward_zero_std": (spread == 0).float().mean().item() if args.num_generations > 1 else 1.0,
        "lr": engine.scheduler.get_last_lr()[0], "perf/rollout_s": rollout_s, "perf/update_s": update_s,
        "perf/update_micro_batch": float(state.micro_batch_size),
        "perf/decode_tokens_per_s": size * rollout.response_mask.shape[1] / max(rollout.generate_s, 1e-9),
        **rollout.reward_metrics})
    if rollout.ref_logprobs is not None:
        metrics["kl"] = (kl_penalty(rollout.logprobs, rollout.ref_logprobs, "k1") * rollout.response_mask).sum(1).mean().item()
    return StepResult(metrics, finite=all_finite, stepped=any_stepped)


def _nan_mean(values: torch.Tensor) -> float:
    """The mean of the scored values; 0.0 when none is (a metric is never NaN in metrics.jsonl)."""
    scored = values[~values.isnan()]
    return scored.mean().item() if scored.numel() else 0.0


def _loss_units(rollout: GroupRollout, idx: torch.Tensor, normalisation: str):
    """What the loss of rows `idx` is a mean over: their response tokens (token: DAPO's one mean over the
    minibatch's tokens) or their rows (sequence, fixed)."""
    return rollout.response_mask[idx].sum() if normalisation == "token" else len(idx)


def _micro_loss(model, rollout: GroupRollout, advantages: torch.Tensor, idx: torch.Tensor, args,
                temperature: float) -> tuple[torch.Tensor, dict]:
    """The clipped-ratio loss (+ beta * k3 to the reference for GRPO) of rollout rows `idx`, trimmed to
    their longest response."""
    mask = rollout.response_mask[idx]
    ids, att, width = trimmed_to_longest_response(rollout.input_ids[idx], rollout.attention_mask[idx], mask)
    logprobs, _ = response_logprobs(model, ids, att, width, POLICY, temperature)
    ref = rollout.ref_logprobs[idx, :width] if args.advantage == "grpo" and args.beta > 0 else None
    loss, stats = grpo_policy_loss(logprobs, rollout.logprobs[idx, :width], advantages[idx], mask[:, :width],
                                   args.cliprange, ref, args.beta if ref is not None else 0.0,
                                   args.loss_normalisation, args.max_new_tokens)
    return loss, {"loss": loss.detach(), "clip_ratio": stats["clipfrac"], "kl_term": stats["kl"],
                  "ratio": stats["ratio"]}
