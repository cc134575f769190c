"""KL coefficient controllers for PPO: a fixed beta, or Ziegler et al. (2019)'s adaptive one.

Both expose `.value` (the beta to use now), `.update(current_kl, n_steps)` after each rollout, and
`state_dict()` / `load_state_dict()` so a resumed run continues with the beta it had reached.
"""

from __future__ import annotations

from typing import Union

import torch

Number = Union[float, torch.Tensor]


class FixedKLController:
    """beta stays at its initial value."""

    kind = "fixed"

    def __init__(self, beta: float):
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.value = float(beta)

    def update(self, current_kl: Number, n_steps: int) -> None:
        """Nothing to adapt; the signature matches AdaptiveKLController so callers need not care."""

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """beta moves so the measured KL tracks `target` (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    error = clip(current_kl / target - 1, -0.2, 0.2); beta *= 1 + error * n_steps / horizon.
    The clip bounds how far one noisy KL estimate can move beta.
    """

    kind = "adaptive"

    def __init__(self, init_beta: float, target: float, horizon: float):
        if init_beta < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"need init_beta >= 0, target > 0, horizon > 0; got {init_beta}, {target}, {horizon}")
        self.value = float(init_beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: Number, n_steps: int) -> None:
        """current_kl: mean KL per sequence of the last rollout; n_steps: how many samples it held."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        # target and horizon are configuration, not state: a resumed run takes them from its config.
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])


KLController = Union[FixedKLController, AdaptiveKLController]


def _check_kind(kind: str, state: dict) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"checkpoint holds a {state.get('kind')!r} KL controller state, this run uses {kind!r}")


def make_kl_controller(
    adaptive: bool, init_beta: float, target: float | None = None, horizon: float | None = None
) -> KLController:
    """An AdaptiveKLController(init_beta, target, horizon) if `adaptive`, else FixedKLController(init_beta)."""
    if not adaptive:
        return FixedKLController(init_beta)
    if target is None or horizon is None:
        raise ValueError("an adaptive KL controller needs both target and horizon")
    return AdaptiveKLController(init_beta, target, horizon)
