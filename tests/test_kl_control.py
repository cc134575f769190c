"""KL controllers against beta sequences worked out by hand."""

from __future__ import annotations

import pytest
import torch

from trainer.rl.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller


def test_fixed_kl_controller_keeps_beta_whatever_the_kl():
    controller = FixedKLController(0.05)
    controller.update(100.0, 256)
    controller.update(0.0, 256)
    assert controller.value == 0.05


def test_adaptive_kl_controller_matches_hand_computed_beta_sequence():
    controller = AdaptiveKLController(init_beta=0.1, target=4.0, horizon=10_000)
    # kl 8: 8/4 - 1 = 1, clipped to 0.2; step factor 1 + 0.2 * 256 / 10000 = 1.00512
    controller.update(8.0, 256)
    beta = 0.1 * 1.00512
    assert controller.value == pytest.approx(beta, rel=1e-12)
    # kl 4.4: error 0.1 (inside the clip); factor 1 + 0.1 * 512 / 10000 = 1.00512
    controller.update(4.4, 512)
    beta *= 1.00512
    assert controller.value == pytest.approx(beta, rel=1e-12)
    # kl 0: error -1, clipped to -0.2; factor 1 - 0.2 * 256 / 10000 = 0.99488
    controller.update(0.0, 256)
    beta *= 0.99488
    assert controller.value == pytest.approx(beta, rel=1e-12)
    # kl on target: no change
    controller.update(4.0, 256)
    assert controller.value == pytest.approx(beta, rel=1e-12)


def test_adaptive_kl_controller_accepts_a_tensor_kl():
    controller = AdaptiveKLController(0.1, 4.0, 10_000)
    controller.update(torch.tensor(3.6), 100)  # error -0.1
    assert controller.value == pytest.approx(0.1 * (1 - 0.1 * 100 / 10_000), rel=1e-6)


def test_adaptive_kl_controller_state_round_trip_resumes_the_same_sequence():
    original = AdaptiveKLController(0.1, 4.0, 10_000)
    original.update(8.0, 256)
    resumed = AdaptiveKLController(0.1, 4.0, 10_000)
    resumed.load_state_dict(original.state_dict())
    assert resumed.value == original.value
    original.update(4.4, 512)
    resumed.update(4.4, 512)
    assert resumed.value == original.value


def test_fixed_kl_controller_state_round_trip():
    restored = FixedKLController(0.2)
    restored.load_state_dict(FixedKLController(0.05).state_dict())
    assert restored.value == 0.05


def test_loading_the_other_controller_kind_fails_clearly():
    with pytest.raises(ValueError, match="'fixed' KL controller state"):
        AdaptiveKLController(0.1, 4.0, 10_000).load_state_dict(FixedKLController(0.1).state_dict())


def test_make_kl_controller_picks_the_kind_and_requires_target_and_horizon_when_adaptive():
    fixed = make_kl_controller(adaptive=False, init_beta=0.05)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = make_kl_controller(adaptive=True, init_beta=0.1, target=6.0, horizon=10_000)
    assert isinstance(adaptive, AdaptiveKLController) and (adaptive.target, adaptive.horizon) == (6.0, 10_000)
    with pytest.raises(ValueError, match="target and horizon"):
        make_kl_controller(adaptive=True, init_beta=0.1)
