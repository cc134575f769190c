"""Which adapters each stage puts on the one shared base: the single table the trainer's stages,
evaluation, comparison and the memory estimator all read.

Four roles exist. `policy` is the model being trained (SFT, DPO, PPO, GRPO), `reference` the frozen
SFT copy it is anchored to (DPO, PPO, GRPO), `value` PPO's critic and `reward` the reward model; the last two
carry a scalar head. A role is trainable only in the stages listed for it in `TRAINED`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

POLICY, REFERENCE, VALUE, REWARD = "policy", "reference", "value", "reward"
ROLES = (POLICY, REFERENCE, VALUE, REWARD)
HEADED = (VALUE, REWARD)  # roles with a scalar head (per-token values, a sequence's reward)

STAGES = ("sft", "reward", "dpo", "ppo", "grpo")
ADAPTERS = {  # in the order they are put on the base; the first is active after loading
    "sft": (POLICY,),
    "reward": (REWARD,),
    "dpo": (POLICY, REFERENCE),
    "ppo": (POLICY, REFERENCE, VALUE, REWARD),
    "grpo": (POLICY, REFERENCE, REWARD),  # critic-free (GRPO, RLOO): no value adapter
}
TRAINED = {"sft": (POLICY,), "reward": (REWARD,), "dpo": (POLICY,), "ppo": (POLICY, VALUE), "grpo": (POLICY,)}


@dataclass(frozen=True)
class Slot:
    """One adapter of a stage: its role (also its name on the base), trainable or frozen, with a head or not."""

    role: str
    trainable: bool
    head: bool


def stage_adapters(stage: str, without: Sequence[str] = ()) -> list[Slot]:
    """The adapters of `stage`, less the roles in `without` (a run scored by reward functions has no
    reward adapter; GRPO with beta 0 no reference)."""
    if stage not in ADAPTERS:
        raise ValueError(f"unknown stage '{stage}': use one of {', '.join(STAGES)}")
    return [Slot(role, role in TRAINED[stage], role in HEADED) for role in ADAPTERS[stage] if role not in without]
