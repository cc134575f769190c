"""One PPO step after the rollout: per-token rewards, GAE advantages, and the clipped update.

Kept apart from the entry script so the maths reads top to bottom and can be tested on its own.
"""

from __future__ import annotations

import gc
import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from trainer.losses import (
    entropy_from_logits, gae, kl_penalty, masked_mean, masked_var, masked_whiten, per_token_rewards,
    ppo_policy_loss, ppo_value_loss, token_logprobs,
)
from trainer.rollout import Rollout

logger = logging.getLogger(__name__)


@dataclass
class Advantages:
    rewards: torch.Tensor  # (B, R) -beta * kl plus the score on the last token
    non_score_reward: torch.Tensor  # (B, R) -beta * kl
    kl: torch.Tensor  # (B, R) per-token KL estimate
    advantages: torch.Tensor  # (B, R) whitened
    returns: torch.Tensor  # (B, R)


def compute_advantages(rollout: Rollout, beta: float, estimator: str, gamma: float, lam: float,
                       whiten_rewards: bool = False) -> Advantages:
    mask = rollout.response_mask
    kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, estimator) * mask
    rewards, non_score = per_token_rewards(rollout.scores, kl, beta, mask)
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, rollout.values, mask, gamma, lam)
    return Advantages(rewards, non_score, kl, masked_whiten(advantages, mask), returns)


def rollout_metrics(rollout: Rollout, adv: Advantages) -> dict[str, float]:
    """TRL-named rollout figures: sums over a response's tokens, means over responses."""
    mask = rollout.response_mask
    kl_sum = adv.kl.sum(1)
    non_score = adv.non_score_reward.sum(1)
    return {
        "objective/kl": kl_sum.mean().item(),
        "objective/entropy": (rollout.entropy * mask).sum(1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (non_score + rollout.scores).mean().item(),
        "objective/scores": rollout.scores.mean().item(),
        "objective/scores_std": rollout.scores.std().item() if rollout.scores.numel() > 1 else 0.0,
        "val/num_eos_tokens": rollout.ended.float().sum().item(),
        "val/response_length": mask.sum(1).mean().item(),
        "val/returns_mean": masked_mean(adv.returns, mask).item(),
        "val/values_mean": masked_mean(rollout.values, mask).item(),
        "val/values_var": masked_var(rollout.values, mask).item() if mask.sum() > 1 else 0.0,
    }


@dataclass
class UpdateConfig:
    ppo_epochs: int
    mini_batch_size: int
    micro_batch_size: int
    cliprange: float
    cliprange_value: float
    vf_coef: float
    entropy_coef: float
    max_grad_norm: float
    temperature: float


def micro_loss(model, sub: Rollout, advantages: torch.Tensor, returns: torch.Tensor, cfg: UpdateConfig):
    """Policy + value loss of one micro-batch, and its detached statistics."""
    mask = sub.response_mask
    width = int(mask.sum(1).max().item())  # trailing columns no row uses cost compute and nothing else
    keep = sub.input_ids.shape[1] - sub.response_length + width
    ids, att = sub.input_ids[:, :keep], sub.attention_mask[:, :keep]
    mask, adv, ret = mask[:, :width], advantages[:, :width], returns[:, :width]
    logits = model(ids, att, adapter="policy", output="logits", keep_last=width + 1)[:, :-1]
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    logprobs = token_logprobs(logits, ids[:, -width:])
    pg_loss, pg_stats = ppo_policy_loss(logprobs, sub.logprobs[:, :width], adv, mask, cfg.cliprange)
    values = model(ids, att, adapter="value", output="scores", keep_last=width + 1)[:, :-1]
    vf_loss, vf_clipfrac = ppo_value_loss(values, sub.values[:, :width], ret, mask, cfg.cliprange_value)
    if cfg.entropy_coef:
        entropy = masked_mean(entropy_from_logits(logits), mask)
    else:
        with torch.no_grad():
            entropy = masked_mean(entropy_from_logits(logits.detach()), mask)
    loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * entropy
    stats = {"loss/policy_avg": pg_loss.detach(), "loss/value_avg": vf_loss.detach(),
             "policy/entropy_avg": entropy.detach(), "policy/approxkl_avg": pg_stats["approxkl"],
             "policy/clipfrac_avg": pg_stats["clipfrac"], "val/clipfrac_avg": vf_clipfrac.detach(),
             "val/ratio": pg_stats["ratio"]}
    return loss, stats


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ppo_update(model, accelerator, optimizer, params, rollout: Rollout, adv: Advantages, cfg: UpdateConfig,
               generator: torch.Generator, on_gradients=None) -> tuple[dict[str, float], int]:
    """`ppo_epochs` passes of shuffled minibatches; one optimizer step per minibatch.

    A CUDA out-of-memory error inside a minibatch drops its partial gradients and retries it with
    half the micro-batch (logged); returns the metrics and the micro-batch size it settled on.
    """
    size = rollout.input_ids.shape[0]
    sums: dict[str, float] = defaultdict(float)
    count = 0
    micro = cfg.micro_batch_size
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(size, generator=generator)
        for start in range(0, size, cfg.mini_batch_size):
            rows = order[start : start + cfg.mini_batch_size]
            while True:
                try:
                    stats = _minibatch(model, accelerator, rollout, adv, rows, micro, cfg)
                    break
                except (torch.OutOfMemoryError, RuntimeError) as exc:
                    if not is_oom(exc) or micro == 1:
                        raise
                    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
                        # The engine owns the gradients and fixed its accumulation at prepare time.
                        raise RuntimeError("out of memory in the PPO update under DeepSpeed: lower "
                                           "micro_batch_size (the automatic retry needs the plain loop)") from exc
                    optimizer.zero_grad(set_to_none=True)
                    free_memory()
                    micro //= 2
                    logger.warning("out of memory in the PPO update: retrying the minibatch with micro-batch %d", micro)
            if on_gradients is not None:
                on_gradients()  # the memory recorder counts gradients while they exist
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            stats["policy/grad_norm"] = accelerator.clip_grad_norm_(params, max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for key, value in stats.items():
                sums[key] += float(value)
            count += 1
    return {k: v / count for k, v in sums.items()}, micro


def _minibatch(model, accelerator, rollout: Rollout, adv: Advantages, rows: torch.Tensor, micro: int,
               cfg: UpdateConfig) -> dict[str, float]:
    steps = -(-len(rows) // micro)
    accelerator.gradient_accumulation_steps = steps
    accelerator.step = 0  # realign the accumulation counter (after an OOM retry, too)
    sums: dict[str, float] = defaultdict(float)
    for i in range(0, len(rows), micro):
        idx = rows[i : i + micro]
        with accelerator.accumulate(model), accelerator.autocast():
            loss, stats = micro_loss(model, rollout.select(idx), adv.advantages[idx], adv.returns[idx], cfg)
            accelerator.backward(loss)
        for key, value in stats.items():
            sums[key] += float(value) / steps
    return dict(sums)
