"""Pure loss functions for SFT, reward modelling, DPO, PPO and GRPO: tensors in, tensors out.

Masks are (B, T), bool or float, 1 on valid tokens; PPO response masks are right-padded (valid tokens
first, padding after). The log-probs these losses take come from `trainer.model.logprobs`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from foundation.settings import GROUP_ADVANTAGES, KL_ESTIMATORS, LOSS_NORMALISATIONS

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


# ---------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over mask != 0 (all dims, or `dim`); an empty mask gives 0, not NaN.

    Masked-out values are dropped with `where`, so inf/NaN on padding cannot leak in.
    """
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x)).sum(dim=dim)
    count = keep.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Scalar variance of x over mask != 0; Bessel-corrected if `unbiased` (one value -> 0)."""
    centered = x - masked_mean(x, mask)
    var = masked_mean(centered * centered, mask)
    if unbiased:
        n = mask.bool().sum().to(var.dtype)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """x scaled to unit variance over mask (and to zero mean if `shift_mean`); 0 on masked-out positions.

    shift_mean=False keeps the mean: PPO whitens rewards that way so their sign survives.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# ---------------------------------------------------------------- a supervised step's mean loss


def step_mean_share(unit_losses: torch.Tensor, normaliser: float) -> torch.Tensor:
    """One micro-batch's share of its optimizer step's mean loss: its units' losses (the NLL of each completion
    token, the loss of each pair) summed, over `normaliser`, the units of the whole step. The shares of a step
    add up to its mean with every unit weighing the same however the units are grouped into micro-batches and
    ranks (a mean per micro-batch weighs a unit by the inverse of its own micro-batch's count)."""
    if not normaliser > 0:
        raise ValueError(f"normaliser must be positive, got {normaliser}")
    return unit_losses.sum() / normaliser


# ---------------------------------------------------------------- reward model and DPO


def pairwise_ranking_losses(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """(N,), (N,) rewards -> (N,) Bradley-Terry losses -logsigmoid(r_chosen - r_rejected), one per pair."""
    return -F.logsigmoid(r_chosen - r_rejected)


def ranking_stats(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """(N,), (N,) -> {"accuracy": fraction with r_chosen > r_rejected (ties count wrong), "margin": mean difference}."""
    diff = (r_chosen - r_rejected).detach()
    return {"accuracy": (diff > 0).float().mean(), "margin": diff.mean()}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N,) sequence log-probs x4 -> (per-example losses, chosen rewards, rejected rewards), each (N,).

    Rewards are beta * (policy - reference) log-probs, detached (they are for logging).
    sigmoid (DPO): -logsigmoid(beta*h)(1-ls) - logsigmoid(-beta*h) ls; ipo: (h - 1/(2 beta))^2;
    hinge (SLiC): relu(1 - beta*h); with h = (pc - pr) - (rc - rr).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}")
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * h)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


# ---------------------------------------------------------------- PPO


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """(B, T), (B, T) -> (B, T) per-token estimate of KL(policy || reference) from sampled tokens.

    k1 = logp - ref (unbiased, can be negative); k2 = (logp - ref)^2 / 2;
    k3 = exp(ref - logp) - 1 - (ref - logp) (unbiased and >= 0; Schulman's "approximating KL").
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio  # expm1 keeps precision when the policies are close


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, beta, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) scores, (B, T) kl, (B, T) mask -> (rewards, non_score_reward), each (B, T), 0 on padding.

    non_score_reward = -beta * kl on valid tokens; rewards adds each row's score at its last valid
    token (a row with no valid token gets no score).
    """
    keep = mask.bool()
    non_score = torch.where(keep, -beta * kl, torch.zeros_like(kl))
    positions = torch.arange(kl.shape[1], device=kl.device).expand_as(keep)
    last = torch.where(keep, positions, -1).max(dim=1).values
    score = torch.where(last >= 0, scores.to(non_score.dtype), 0.0)
    rewards = non_score.scatter_add(1, last.clamp(min=0).unsqueeze(1), score.unsqueeze(1))
    return rewards, non_score


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) rewards, values, right-padded mask -> (advantages, returns), each (B, T), 0 on padding.

    Generalized advantage estimation, backwards over time; the value after the last valid token
    is 0 (the response ends the episode). returns = advantages + values. No gradient flows.
    """
    keep = mask.bool()
    rewards = torch.where(keep, rewards, 0.0)
    values = torch.where(keep, values, 0.0)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # A padded step resets the recursion, so nothing from padding reaches the valid tokens.
        next_advantage = torch.where(keep[:, t], delta + gamma * lam * next_advantage, 0.0)
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages, advantages + values


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) x3 + mask -> (scalar clipped surrogate loss, stats), PPO's pessimistic objective.

    loss = masked mean of max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps)), ratio = exp(logp - old).
    stats (detached): clipfrac (share of valid tokens where the clipped term won), approxkl
    (masked mean of (logp - old)^2 / 2), ratio (masked mean).
    """
    keep = mask.bool()
    # Zero the log-ratio on padding before exp: an inf there would turn the masked gradient into NaN.
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approxkl": masked_mean(0.5 * log_ratio**2, mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) x3 + mask -> (scalar loss, clipfrac): 0.5 * masked mean of max((v-R)^2, (v_clipped-R)^2).

    v_clipped keeps the new value within clip_range_value of the rollout's; clipfrac is the share of
    valid tokens where the clipped error was the larger (detached).
    """
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return loss, clipfrac


def last_token_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values -> (B,) value at each row's last valid token (left or right padding)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values.clamp(min=0)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def group_advantages(rewards: torch.Tensor, method: str = "grpo", scale_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """(P, G) rewards of G responses to each of P prompts -> (P, G) advantages, one per response.

    grpo: (r - group mean) / (group std + eps), the std unbiased over the group (as TRL); with
    `scale_std` False (Dr. GRPO) only the mean is taken off. A group of one response has std 0 and
    advantage 0. rloo: r_i - mean of the group's other rewards (leave-one-out), which needs G >= 2.
    Groups whose rewards are all equal get advantage exactly 0 either way (the fp32 mean of equal values
    can miss them by an ulp, which the division by std + eps would magnify to a push of one sign).
    A NaN reward (a response no reward function scored) is left out of its group's mean and std, and its
    advantage is 0, as TRL's GRPOTrainer does.
    """
    if method not in GROUP_ADVANTAGES:
        raise ValueError(f"method must be one of {GROUP_ADVANTAGES}, got {method!r}")
    rewards = rewards.float()
    if method == "rloo" and rewards.shape[1] < 2:
        raise ValueError("rloo needs at least 2 responses per prompt (num_generations >= 2)")
    scored = ~torch.isnan(rewards)
    count, mean, std = group_mean_std(rewards)
    first = rewards.gather(1, scored.float().argmax(dim=1, keepdim=True))  # a scored reward of each group
    equal = torch.where(scored, rewards == first, True).all(dim=1, keepdim=True)
    if method == "rloo":
        total = torch.where(scored, rewards, 0.0).sum(dim=1, keepdim=True)
        advantages = rewards - (total - rewards) / (count - 1).clamp(min=1)
    else:
        advantages = rewards - mean
        if scale_std:
            advantages = advantages / (std + eps)
    return torch.where(equal | (count < 2) | ~scored, 0.0, advantages)


def group_mean_std(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P, G) rewards -> (P, 1) count, mean and unbiased std of each group's rewards that are not NaN (the
    responses a reward function scored); std 0 below two of them."""
    scored = ~torch.isnan(rewards)
    count = scored.sum(dim=1, keepdim=True)
    mean = torch.where(scored, rewards, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    squares = torch.where(scored, (rewards - mean) ** 2, 0.0).sum(dim=1, keepdim=True)
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), 0.0)
    return count, mean, std


def grpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    ref_logprobs: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    normalisation: str = "sequence",
    max_length: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) log-probs, old log-probs, mask and (B,) sequence advantages -> (scalar loss, stats).

    Per token: max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps)) + beta * k3(policy || reference), the
    k3 term only when beta > 0 (then `ref_logprobs` is needed). Reduced by `normalisation`:
    sequence = mean over each response's tokens, then over responses (GRPO's paper); token = sum over
    every token / number of tokens (long responses weigh more, DAPO; the update weighs each micro-batch by
    its tokens, so a minibatch is one such mean); fixed = sum / (B x max_length) (Dr. GRPO: no length
    bias from the divisor).
    """
    if normalisation not in LOSS_NORMALISATIONS:
        raise ValueError(f"normalisation must be one of {LOSS_NORMALISATIONS}, got {normalisation!r}")
    keep = mask.bool()
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_token = torch.maximum(unclipped, clipped)
    kl = None
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        # Padding zeroed before the exponential: a padded log-prob far below the reference's overflows exp,
        # and inf times the mask's 0 is a NaN gradient.
        kl = kl_penalty(torch.where(keep, logprobs, 0.0), torch.where(keep, ref_logprobs, 0.0), "k3")
        per_token = per_token + beta * kl
    maskf = mask.to(per_token.dtype)
    if normalisation == "sequence":
        loss = ((per_token * maskf).sum(1) / maskf.sum(1).clamp(min=1)).mean()
    elif normalisation == "token":
        loss = (per_token * maskf).sum() / maskf.sum().clamp(min=1)
    else:
        if max_length is None:
            raise ValueError("normalisation 'fixed' needs max_length")
        loss = (per_token * maskf).sum() / (mask.shape[0] * max_length)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
                 "ratio": masked_mean(ratio, mask),
                 "kl": masked_mean(kl, mask) if kl is not None else torch.zeros((), dtype=ratio.dtype)}
    return loss, stats
