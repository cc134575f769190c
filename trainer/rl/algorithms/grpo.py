"""GRPO, critic-free: each prompt's G responses are a group, and a response's advantage is its reward's
z-score in its group (Dr. GRPO: not divided by the std); the loss is the clipped ratio loss plus beta x the k3
estimate of the KL to the reference. The loss terms are `trainer.losses`' pure functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.stages import POLICY
from trainer.losses import group_advantages, group_mean_std, grpo_policy_loss, kl_penalty
from trainer.rl.rollout import Rollout
from trainer.rl.scoring import response_logprobs, trimmed_to_longest_response
from trainer.rl.online import Algorithm, RLState


@dataclass
class GroupAdvantages:
    advantages: torch.Tensor  # (P*G,) one per response
    rewards: torch.Tensor  # (P*G,) what they came from

    def buffers(self) -> list[torch.Tensor]:
        return [self.advantages, self.rewards]


class GRPO(Algorithm):
    """`args`: GRPOArguments; `rollout_batch_size` prompts x `num_generations` responses per step."""

    name, nan_unscored, kind = "GRPO", True, "grpo"

    def __init__(self, args):
        super().__init__(args, epochs=args.epochs, group=args.num_generations, reference=args.beta > 0)

    def rewards(self, rollout: Rollout) -> torch.Tensor:
        """(P*G,) what the advantages compare within each group: GRPO's are the scores."""
        return rollout.scores

    @property
    def loss_beta(self) -> float:
        """The weight of the k3 KL term in the loss."""
        return self.args.beta

    def advantages(self, rollout: Rollout, state: RLState) -> GroupAdvantages:
        rewards = self.rewards(rollout)
        groups = rewards.view(-1, rollout.group)
        return GroupAdvantages(group_advantages(groups, self.kind, self.args.scale_rewards).flatten(), rewards)

    def metrics(self, rollout: Rollout, adv: GroupAdvantages, state: RLState) -> dict[str, float]:
        """TRL's GRPOTrainer names; each prompt's spread of scores leaves a NaN (unscored) response out."""
        spread = group_mean_std(rollout.scores.view(-1, rollout.group))[2]
        mask = rollout.response_mask
        metrics = {"reward": _nan_mean(adv.rewards), "reward_std": _nan_mean(spread),
                   "objective/scores": _nan_mean(rollout.scores),
                   "frac_reward_unscored": rollout.scores.isnan().float().mean().item(),
                   "completions/mean_length": mask.sum(1).mean().item(),
                   "completions/clipped_ratio": (~rollout.ended).float().mean().item(),
                   "frac_reward_zero_std": (spread == 0).float().mean().item(), **rollout.reward_metrics}
        if rollout.ref_logprobs is not None:
            metrics["kl"] = (kl_penalty(rollout.logprobs, rollout.ref_logprobs, "k1") * mask).sum(1).mean().item()
        return metrics

    def loss_units(self, rollout: Rollout, rows: torch.Tensor):
        """token: the minibatch's response tokens (DAPO's one mean over them); sequence, fixed: its rows."""
        return rollout.response_mask[rows].sum() if self.args.loss_normalisation == "token" else len(rows)

    def loss(self, model, rollout: Rollout, adv: GroupAdvantages, rows: torch.Tensor, temperature: float):
        """The clipped-ratio loss (+ beta x k3 to the reference) of rollout rows `rows`, trimmed to their
        longest response."""
        args, mask = self.args, rollout.response_mask[rows]
        ids, att, width = trimmed_to_longest_response(rollout.input_ids[rows], rollout.attention_mask[rows], mask)
        logprobs, _ = response_logprobs(model, ids, att, width, POLICY, temperature)
        beta = self.loss_beta if rollout.ref_logprobs is not None else 0.0
        ref = rollout.ref_logprobs[rows, :width] if beta > 0 else None
        loss, stats = grpo_policy_loss(logprobs, rollout.logprobs[rows, :width], adv.advantages[rows],
                                       mask[:, :width], args.cliprange, ref, beta, args.loss_normalisation,
                                       args.max_new_tokens)
        return loss, {"loss": loss.detach(), "clip_ratio": stats["clipfrac"], "kl_term": stats["kl"],
                      "ratio": stats["ratio"]}


def _nan_mean(values: torch.Tensor) -> float:
    """The mean of the scored values; 0.0 when none is (a metric is never NaN in metrics.jsonl)."""
    scored = values[~values.isnan()]
    return scored.mean().item() if scored.numel() else 0.0
