"""Loss functions against values worked out by hand (plain Python arithmetic, not the code under test)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from trainer.losses import (
    dpo_loss,
    gae,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    pairwise_ranking_losses,
    per_token_rewards,
    ppo_policy_loss,
    ppo_value_loss,
    ranking_stats,
    step_mean_share,
)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------- SFT


def test_masked_mean_ignores_padding_even_when_it_holds_inf_and_nan():
    x = t([[1.0, 3.0, float("inf")], [4.0, float("nan"), 8.0]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    assert_close(masked_mean(x, mask), t((1 + 3 + 4 + 8) / 4))
    assert_close(masked_mean(x, mask, dim=1), t([2.0, 6.0]))
    assert_close(masked_mean(x, torch.zeros(2, 3)), t(0.0))


def test_masked_var_is_bessel_corrected_over_valid_values_only():
    x = t([1.0, 3.0, 5.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    # mean 3, squared deviations 4 + 0 + 4 = 8
    assert_close(masked_var(x, mask), t(8 / 2))
    assert_close(masked_var(x, mask, unbiased=False), t(8 / 3))


def test_masked_whiten_gives_unit_variance_and_optionally_keeps_the_mean():
    x = t([1.0, 3.0, 5.0, 100.0])
    mask = t([1, 1, 1, 0])
    # mean 3, unbiased std 2
    assert_close(masked_whiten(x, mask), t([-1.0, 0.0, 1.0, 0.0]))
    assert_close(masked_whiten(x, mask, shift_mean=False), t([2.0, 3.0, 4.0, 0.0]))


# ---------------------------------------------------------------- a supervised step's mean loss


def test_step_mean_shares_add_up_to_the_steps_token_mean_however_the_micro_batches_split_it():
    # One step of 5 completion tokens with NLL 1, 2, 3, 4, 10 (row padding holds 0), in micro-batches of
    # 3 + 2 tokens or 4 + 1: each share is its sum over 5, the step's mean is 20 / 5 = 4 either way.
    first, second = t([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), t([[4.0, 10.0]])
    assert_close(step_mean_share(first, 5), t(6 / 5))
    assert_close(step_mean_share(second, 5), t(14 / 5))
    assert_close(step_mean_share(first, 5) + step_mean_share(second, 5), t(4.0))
    assert_close(step_mean_share(t([1.0, 2.0, 3.0, 4.0]), 5) + step_mean_share(t([10.0]), 5), t(4.0))
    # A mean per micro-batch would weigh the lone token of the second split 4 times as much: (10/4 + 10) / 2.
    assert (t([1.0, 2.0, 3.0, 4.0]).mean() + t([10.0]).mean()) / 2 == 6.25
    # Gradient: d share / d unit = 1 / normaliser for every unit.
    units = t([2.0, 7.0]).requires_grad_()
    step_mean_share(units, 4).backward()
    assert_close(units.grad, t([0.25, 0.25]))
    with pytest.raises(ValueError, match="normaliser must be positive"):
        step_mean_share(first, 0)


# ---------------------------------------------------------------- reward model and DPO


def test_pairwise_ranking_loss_and_stats_match_bradley_terry_by_hand():
    chosen, rejected = t([1.0, 0.0, 2.0]), t([0.0, 0.0, 3.0])
    # margins 1, 0, -1: -log sigmoid(m) = log(1 + e^-m)
    per_pair = [math.log(1 + math.exp(-1)), math.log(2), math.log(1 + math.exp(1))]
    assert_close(pairwise_ranking_losses(chosen, rejected), t(per_pair))
    stats = ranking_stats(chosen, rejected)
    assert_close(stats["accuracy"], t(1 / 3))  # the tie counts as wrong
    assert_close(stats["margin"], t(0.0))


def dpo_inputs():
    # h = (pc - pr) - (rc - rr): example 0: (-1 + 3) - (-2 + 2) = 2; example 1: (-1 + 21) - 0 = 20
    return t([-1.0, -1.0]), t([-3.0, -21.0]), t([-2.0, -2.0]), t([-2.0, -2.0])


def test_dpo_sigmoid_loss_with_and_without_label_smoothing_matches_hand_values():
    losses, chosen_rewards, rejected_rewards = dpo_loss(*dpo_inputs(), beta=0.1)
    assert_close(losses, t([math.log(1 + math.exp(-0.2)), math.log(1 + math.exp(-2.0))]))
    assert_close(chosen_rewards, t([0.1 * 1.0, 0.1 * 1.0]))
    assert_close(rejected_rewards, t([0.1 * -1.0, 0.1 * -19.0]))
    smoothed, _, _ = dpo_loss(*dpo_inputs(), beta=0.1, label_smoothing=0.25)
    expected = [0.75 * math.log(1 + math.exp(-bh)) + 0.25 * math.log(1 + math.exp(bh)) for bh in (0.2, 2.0)]
    assert_close(smoothed, t(expected))


def test_dpo_ipo_and_hinge_losses_match_hand_values():
    ipo, _, _ = dpo_loss(*dpo_inputs(), beta=0.1, loss_type="ipo")
    assert_close(ipo, t([(2 - 5.0) ** 2, (20 - 5.0) ** 2]))  # 1 / (2 beta) = 5
    hinge, _, _ = dpo_loss(*dpo_inputs(), beta=0.1, loss_type="hinge")
    assert_close(hinge, t([1 - 0.2, 0.0]))


def test_dpo_rewards_are_detached_and_loss_carries_gradient():
    pc, pr, rc, rr = dpo_inputs()
    pc.requires_grad_(True)
    losses, chosen_rewards, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert losses.requires_grad and not chosen_rewards.requires_grad


def test_dpo_rejects_unknown_loss_type_and_smoothing_outside_sigmoid():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(*dpo_inputs(), beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*dpo_inputs(), beta=0.1, loss_type="ipo", label_smoothing=0.1)


# ---------------------------------------------------------------- PPO


def test_kl_penalty_estimators_match_hand_values():
    logp, ref = t([-1.0, -2.0]), t([-2.0, -1.5])  # logp - ref = 1, -0.5
    assert_close(kl_penalty(logp, ref, "k1"), t([1.0, -0.5]))
    assert_close(kl_penalty(logp, ref, "k2"), t([0.5, 0.125]))
    # r = ref - logp = -1, 0.5: e^r - 1 - r
    assert_close(kl_penalty(logp, ref, "k3"), t([math.exp(-1) - 1 + 1, math.exp(0.5) - 1 - 0.5]))
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k4")


def test_per_token_rewards_adds_score_at_last_valid_token_and_zeros_padding():
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [0.7, 0.8, 0.9]])
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards, non_score = per_token_rewards(t([1.0, 2.0, 3.0]), kl, 0.5, mask)
    assert_close(non_score, t([[-0.05, -0.1, -0.15], [-0.2, -0.25, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(rewards, t([[-0.05, -0.1, -0.15 + 1.0], [-0.2, -0.25 + 2.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_matches_hand_computed_advantages_with_gamma_and_lambda_below_one():
    gamma, lam = 0.9, 0.8
    nan = float("nan")
    rewards = t([[1.0, 0.0, 2.0], [1.0, 2.0, nan]])
    values = t([[0.5, 1.0, 1.5], [0.5, 1.0, 7.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    # row 0, backwards: delta_t = r_t + gamma V_{t+1} - V_t (V_3 = 0); A_t = delta_t + gamma lam A_{t+1}
    a02 = 2.0 + 0.0 - 1.5
    a01 = (0.0 + 0.9 * 1.5 - 1.0) + 0.72 * a02
    a00 = (1.0 + 0.9 * 1.0 - 0.5) + 0.72 * a01
    # row 1 ends at t=1: the padded value 7.0 and reward NaN must not reach it (V_2 counts as 0)
    a11 = 2.0 + 0.0 - 1.0
    a10 = (1.0 + 0.9 * 1.0 - 0.5) + 0.72 * a11
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    assert_close(advantages, t([[a00, a01, a02], [a10, a11, 0.0]]))
    assert_close(advantages[0], t([1.9112, 0.71, 0.5]))  # the same numbers written out
    assert_close(returns, t([[a00 + 0.5, a01 + 1.0, a02 + 1.5], [a10 + 0.5, a11 + 1.0, 0.0]]))


def test_gae_of_the_short_row_equals_gae_of_that_row_unpadded():
    rewards, values = t([[1.0, 2.0, 5.0]]), t([[0.5, 1.0, 3.0]])
    padded, _ = gae(rewards, values, t([[1, 1, 0]]), 0.9, 0.8)
    alone, _ = gae(rewards[:, :2], values[:, :2], t([[1, 1]]), 0.9, 0.8)
    assert_close(padded[:, :2], alone)


def ppo_policy_case():
    # tokens: ratio 1.1 A+ (inside), 1.5 A+ (above, clipped), 1.5 A- (above, unclipped),
    #         0.5 A- (below, clipped), 0.5 A+ (below, unclipped), then padding with a wild log-prob.
    ratios = [1.1, 1.5, 1.5, 0.5, 0.5, 1.0]
    old = t([[-1.0, -2.0, -1.5, -0.5, -3.0, -1.0]], torch.float64)
    logp = old + t([[math.log(r) for r in ratios]], torch.float64)
    logp[0, -1] = 500.0
    advantages = t([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]], torch.float64)
    mask = t([[1, 1, 1, 1, 1, 0]], torch.float64)
    return logp, old, advantages, mask


def test_ppo_policy_loss_clips_only_the_optimistic_side_for_both_advantage_signs():
    logp, old, advantages, mask = ppo_policy_case()
    logp.requires_grad_(True)
    loss, stats = ppo_policy_loss(logp, old, advantages, mask, clip_range=0.2)
    # max(-A r, -A clip(r)): -1.1, max(-1.5, -1.2), max(1.5, 1.2), max(0.5, 0.8), max(-0.5, -0.8)
    per_token = [-1.1, -1.2, 1.5, 0.8, -0.5]
    assert_close(loss, t(sum(per_token) / 5, torch.float64))
    assert_close(stats["clipfrac"], t(2 / 5, torch.float64))
    assert_close(stats["ratio"], t((1.1 + 1.5 + 1.5 + 0.5 + 0.5) / 5, torch.float64))
    approxkl = sum(0.5 * math.log(r) ** 2 for r in [1.1, 1.5, 1.5, 0.5, 0.5]) / 5
    assert_close(stats["approxkl"], t(approxkl, torch.float64))
    loss.backward()
    # d/dlogp of -A r / n is -A r / n where unclipped; clipped tokens and padding get no gradient
    assert_close(logp.grad, t([[-1.1 / 5, 0.0, 1.5 / 5, 0.0, -0.5 / 5, 0.0]], torch.float64))


def test_ppo_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    old = t([[1.0, 1.0, 1.0, 1.0]])
    values = t([[1.1, 1.5, 1.5, 50.0]]).requires_grad_(True)
    returns = t([[2.0, 2.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, clipfrac = ppo_value_loss(values, old, returns, mask, clip_range_value=0.2)
    # inside: (1.1-2)^2 = 0.81 both; v=1.5 clipped to 1.2, R=2: max(0.25, 0.64) = 0.64 (clipped won);
    # v=1.5, R=0: max(2.25, 1.44) = 2.25 (unclipped won)
    assert_close(loss, t(0.5 * (0.81 + 0.64 + 2.25) / 3))
    assert_close(clipfrac, t(1 / 3))
    loss.backward()
    # d/dv 0.5 (v-R)^2 / n = (v-R) / n on the unclipped winners; 0 where the clipped branch won
    assert_close(values.grad, t([[(1.1 - 2.0) / 3, 0.0, 1.5 / 3, 0.0]]))


# ---- critic-free group advantages and the GRPO loss (hand-computed values)

def test_grpo_advantages_are_group_z_scores_with_the_unbiased_std():
    from trainer.losses import group_advantages

    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    adv = group_advantages(rewards, "grpo", eps=0.0)
    # group 1: mean 2, unbiased std 1 -> -1, 0, 1; group 2: all equal -> 0 (0 / (0 + eps) with eps 0 is nan)
    assert_close(adv[0], torch.tensor([-1.0, 0.0, 1.0]))
    assert_close(group_advantages(rewards, "grpo")[1], torch.zeros(3))
    assert_close(group_advantages(rewards, "grpo", scale_std=False), torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    assert_close(group_advantages(torch.tensor([[4.0], [-2.0]]), "grpo"), torch.zeros(2, 1))  # one response each


def test_rloo_advantages_subtract_the_mean_of_the_other_responses():
    from trainer.losses import group_advantages

    rewards = torch.tensor([[1.0, 2.0, 6.0], [3.0, 3.0, 3.0]])
    # r_i - mean(others): 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5
    assert_close(group_advantages(rewards, "rloo"), torch.tensor([[-3.0, -1.5, 4.5], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.tensor([[1.0]]), "rloo")


def test_grpo_loss_by_hand_for_each_normalisation_and_the_k3_term():
    from trainer.losses import grpo_policy_loss

    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    # row 0: ratio 1.5 clipped to 1.2 with A=1: max(-1.5, -1.2) = -1.2; token 2: -1. row 1: ratio 0.5, A=-2:
    # max(1.0, 2 * 0.8 = 1.6) = 1.6
    loss, stats = grpo_policy_loss(logprobs, old, adv, mask, 0.2, normalisation="sequence")
    assert_close(loss, torch.tensor(((-1.2 - 1.0) / 2 + 1.6) / 2))
    assert_close(stats["clipfrac"], torch.tensor(2 / 3))
    loss, _ = grpo_policy_loss(logprobs, old, adv, mask, 0.2, normalisation="token")
    assert_close(loss, torch.tensor((-1.2 - 1.0 + 1.6) / 3))
    loss, _ = grpo_policy_loss(logprobs, old, adv, mask, 0.2, normalisation="fixed", max_length=4)
    assert_close(loss, torch.tensor((-1.2 - 1.0 + 1.6) / 8))
    # k3 with ref = logp - log 2 on every token: exp(-log 2) - 1 + log 2 = log 2 - 0.5 per token
    ref = logprobs - math.log(2.0)
    with_kl, stats = grpo_policy_loss(logprobs, old, adv, mask, 0.2, ref_logprobs=ref, beta=0.1, normalisation="token")
    assert_close(with_kl, torch.tensor((-1.2 - 1.0 + 1.6) / 3 + 0.1 * (math.log(2.0) - 0.5)))
    assert_close(stats["kl"], torch.tensor(math.log(2.0) - 0.5))
    # beta 0: no reference needed at all
    assert grpo_policy_loss(logprobs, old, adv, mask, 0.2, beta=0.0)[1]["kl"] == 0
    with pytest.raises(ValueError, match="reference"):
        grpo_policy_loss(logprobs, old, adv, mask, 0.2, beta=0.1)


def test_groups_of_equal_rewards_get_advantages_of_exactly_zero_despite_the_fp32_mean():
    from trainer.losses import group_advantages

    # fp32 means of these groups miss the value by an ulp; grpo's division by (std + 1e-4) made that
    # residue up to ~0.019 of one sign. Each method must give exactly 0.0, and leave other groups alone.
    assert group_advantages(torch.tensor([[1.0, 1.0, 1.0]]), "grpo").tolist() == [[0.0, 0.0, 0.0]]
    for value, size in ((0.7, 8), (20.3, 6), (0.35, 16)):
        rewards = torch.tensor([[value] * size, [1.0, 2.0, 3.0] + [2.0] * (size - 3)])
        for method, scale_std in (("grpo", True), ("grpo", False), ("rloo", True)):
            adv = group_advantages(rewards, method, scale_std)
            assert adv[0].tolist() == [0.0] * size, (value, size, method, scale_std)
            assert adv[1, 0] < 0 < adv[1, 2]


def test_grpo_k3_term_gives_a_finite_gradient_when_a_padded_log_prob_is_minus_1000():
    from trainer.losses import grpo_policy_loss

    # padding's log-prob of -1000 against a reference of 0 was exp(1000) = inf before the mask: NaN gradient
    mask = torch.tensor([[1, 1, 0]])
    ref = torch.tensor([[-math.log(2.0), 0.0, 0.0]])
    grads = []
    for padded in (0.0, -1000.0):
        logprobs = torch.tensor([[0.0, 0.0, padded]], requires_grad=True)
        loss, stats = grpo_policy_loss(logprobs, logprobs.detach(), torch.tensor([0.0]), mask, 0.2,
                                       ref_logprobs=ref, beta=0.1, normalisation="token")
        loss.backward()
        # k3 on token 0 (logp - ref = log 2): exp(-log 2) - 1 + log 2 = log 2 - 0.5; 0 on token 1; mean of 2
        assert_close(loss, torch.tensor(0.1 * (math.log(2.0) - 0.5) / 2))
        grads.append(logprobs.grad)
    # d k3 / d logp = 1 - exp(ref - logp): 1 - 1/2 on token 0, 0 on token 1, nothing from padding
    assert_close(grads[1], torch.tensor([[0.1 * 0.5 / 2, 0.0, 0.0]]))
    assert_close(grads[0], grads[1])


def test_group_advantages_leave_an_unscored_response_out_and_give_it_zero_as_trl_does():
    """NaN: every reward function returned None. Group [1, 2, NaN, 3]: mean 2 and std 1 over the three scored,
    advantages -1, 0, 0, 1 (TRL's nanmean / nanstd); a group with one scored response, or none, is all 0."""
    from trainer.losses import group_advantages

    nan = float("nan")
    rewards = torch.tensor([[1.0, 2.0, nan, 3.0], [nan, 5.0, nan, nan], [nan, nan, nan, nan], [4.0, nan, 4.0, 1.0]])
    adv = group_advantages(rewards, "grpo", eps=0.0)
    assert_close(adv[0], torch.tensor([-1.0, 0.0, 0.0, 1.0]))
    assert_close(adv[1:3], torch.zeros(2, 4))
    assert_close(adv[3], torch.tensor([1.0, 0.0, 1.0, -2.0]) / 3 ** 0.5)  # mean 3, std sqrt(3)
    assert_close(group_advantages(rewards, "grpo", scale_std=False)[0], torch.tensor([-1.0, 0.0, 0.0, 1.0]))
    # rloo: r_i minus the mean of the group's other scored rewards
    assert_close(group_advantages(rewards, "rloo")[0], torch.tensor([-1.5, 0.0, 0.0, 1.5]))
    assert not torch.isnan(group_advantages(rewards, "rloo")).any()
