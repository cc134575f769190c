"""RLOO: GRPO's step with a leave-one-out baseline - a response's advantage is its reward less the mean of
its group's other rewards - and the KL to the reference in the reward (-beta x the k1 estimate summed over
the response), not in the loss, as TRL's RLOOTrainer does."""

from __future__ import annotations

import torch

from trainer.losses import kl_penalty
from trainer.rl.algorithms.grpo import GRPO
from trainer.rl.rollout import Rollout


class RLOO(GRPO):
    name, kind = "RLOO", "rloo"
    loss_beta = 0.0  # the KL is in the reward

    def rewards(self, rollout: Rollout) -> torch.Tensor:
        if rollout.ref_logprobs is None:  # beta 0
            return rollout.scores
        kl = (kl_penalty(rollout.logprobs, rollout.ref_logprobs, "k1") * rollout.response_mask).sum(1)
        return rollout.scores - self.args.beta * kl
