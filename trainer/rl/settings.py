"""What PPO and GRPO do at start with the settings they share (`foundation.settings.RolloutArguments`:
adapters, reward functions, rollout sizes, sampling, clipping, evaluation): the scorer, the checks that need
it, the warning for unlikely learning.
"""

from __future__ import annotations

import logging

from foundation.cli import UsageError
from foundation.reward_specs import parse_weights, split_specs
from foundation.settings import RolloutArguments
from foundation.stages import REWARD
from trainer.rl.rewards import Scorer, describe, load_reward_functions

logger = logging.getLogger(__name__)

HOT_TEMPERATURE = 2.0  # above it, samples are close to random tokens and the policy's gradient is 1/T of its own


def reward_functions(args: RolloutArguments) -> tuple[list[str], list[float]]:
    """The reward functions the settings name and their weights: --reward_fn's, then --scripted_reward's (1)."""
    specs = split_specs(args.reward_fn)
    weights = parse_weights(args.reward_weights, len(specs))
    if args.scripted_reward:
        specs, weights = specs + [args.scripted_reward], weights + [1.0]
    return specs, weights


def require_scorer(args: RolloutArguments, stage: str) -> None:
    if args.reward_adapter is None and not reward_functions(args)[0]:
        raise UsageError(f"{stage} needs a scorer: pass --reward_adapter DIR (from trainer/reward.py), --reward_fn "
                         "PATH.py:NAME or --scripted_reward keyword:WORD|length:N|chars:N")


def warn_if_learning_unlikely(args: RolloutArguments) -> None:
    """One warning at start for sampling under which the policy can learn, but hardly."""
    if args.temperature > HOT_TEMPERATURE:
        logger.warning("--temperature %s: responses are close to random tokens and the policy's log-probs at that "
                       "temperature move %.3gx as fast as at 1.0, so learning is unlikely (1.0 is usual)",
                       args.temperature, 1 / args.temperature)


def make_scorer(args: RolloutArguments, tokenizer) -> Scorer:
    """The reward functions (imported here) plus the frozen reward adapter + head, if one is set."""
    functions = load_reward_functions(*reward_functions(args))
    if functions:
        logger.info("%s", describe(functions))
    return Scorer(functions, tokenizer, REWARD if args.reward_adapter is not None else None, args.reward_timeout_s)
