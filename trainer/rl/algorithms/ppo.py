"""PPO: per-token rewards (the score on the last token, -beta * KL on every token), whitened GAE advantages
against the value model's estimates, the clipped policy + value loss of one routed pass, and beta from the KL
controller, updated after each step. The loss terms are `trainer.losses`' pure functions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.engine.metrics import mean_over_ranks
from trainer.losses import (
    gae, kl_penalty, masked_mean, masked_var, masked_whiten, per_token_rewards, ppo_policy_loss, ppo_value_loss,
)
from trainer.rl.kl_control import KLController, make_kl_controller
from trainer.rl.rollout import Rollout
from trainer.rl.scoring import policy_and_values, trimmed_to_longest_response
from trainer.rl.online import Algorithm, RLState


@dataclass
class Advantages:
    rewards: torch.Tensor  # (B, R) -beta * kl plus the score on the last token
    non_score_reward: torch.Tensor  # (B, R) -beta * kl
    kl: torch.Tensor  # (B, R) per-token KL estimate
    advantages: torch.Tensor  # (B, R) whitened
    returns: torch.Tensor  # (B, R)

    def buffers(self) -> list[torch.Tensor]:
        return [self.advantages, self.returns, self.rewards]


def compute_advantages(rollout: Rollout, beta: float, args) -> Advantages:
    """Per-token rewards (score at the last token, -beta * KL on every token) and whitened GAE advantages."""
    mask = rollout.response_mask
    kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator) * mask
    rewards, non_score = per_token_rewards(rollout.scores, kl, beta, mask)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, rollout.values, mask, args.gamma, args.lam)
    return Advantages(rewards, non_score, kl, masked_whiten(advantages, mask), returns)


def rollout_metrics(rollout: Rollout, adv: Advantages) -> dict[str, float]:
    """TRL-named rollout figures: sums over a response's tokens, means over responses."""
    mask = rollout.response_mask
    non_score = adv.non_score_reward.sum(1)
    return {
        "objective/kl": adv.kl.sum(1).mean().item(),
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
        **rollout.reward_metrics,
    }


def micro_loss(model, sub: Rollout, advantages: torch.Tensor, returns: torch.Tensor, args, temperature: float):
    """Policy + value loss of one micro-batch, and its detached statistics."""
    ids, att, width = trimmed_to_longest_response(sub.input_ids, sub.attention_mask, sub.response_mask)
    mask, adv, ret = sub.response_mask[:, :width], advantages[:, :width], returns[:, :width]
    logprobs, entropy, values = policy_and_values(model, ids, att, width, temperature)
    pg_loss, pg_stats = ppo_policy_loss(logprobs, sub.logprobs[:, :width], adv, mask, args.cliprange)
    vf_loss, vf_clipfrac = ppo_value_loss(values, sub.values[:, :width], ret, mask, args.cliprange_value)
    entropy = masked_mean(entropy if args.entropy_coef else entropy.detach(), mask)
    loss = pg_loss + args.vf_coef * vf_loss - args.entropy_coef * entropy
    stats = {"loss/policy_avg": pg_loss.detach(), "loss/value_avg": vf_loss.detach(),
             "policy/entropy_avg": entropy.detach(), "policy/approxkl_avg": pg_stats["approxkl"],
             "policy/clipfrac_avg": pg_stats["clipfrac"], "val/clipfrac_avg": vf_clipfrac.detach(),
             "val/ratio": pg_stats["ratio"]}
    return loss, stats


class PPO(Algorithm):
    """`args`: PPOArguments. Token-mean losses: micro-batches weigh by their response tokens."""

    name, value, grad_norm_key = "PPO", True, "policy/grad_norm"

    def __init__(self, args):
        super().__init__(args, epochs=args.ppo_epochs)

    def kl_controller(self) -> KLController:
        args = self.args
        return make_kl_controller(args.adaptive_kl, args.init_kl_coef, args.target_kl, args.kl_horizon)

    def advantages(self, rollout: Rollout, state: RLState) -> Advantages:
        return compute_advantages(rollout, state.kl.value, self.args)

    def metrics(self, rollout: Rollout, adv: Advantages, state: RLState) -> dict[str, float]:
        return {**rollout_metrics(rollout, adv), "objective/kl_coef": state.kl.value}

    def loss(self, model, rollout: Rollout, adv: Advantages, rows: torch.Tensor, temperature: float):
        return micro_loss(model, rollout.select(rows), adv.advantages[rows], adv.returns[rows], self.args, temperature)

    def after_update(self, metrics: dict[str, float], state: RLState, accelerator) -> None:
        # The controller sees the KL averaged over ranks: every rank keeps the same beta (and a NaN KL
        # would make it NaN for good: such a step leaves it alone).
        kl = mean_over_ranks(accelerator, {"kl": metrics["objective/kl"]})["kl"]
        if math.isfinite(kl):
            state.kl.update(kl, self.args.rollout_batch_size * accelerator.num_processes)
