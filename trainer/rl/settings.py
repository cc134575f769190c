"""The settings PPO and GRPO share - adapters, reward functions, rollout sizes, sampling, clipping, evaluation -
and what both do with them at start: the checks, the warning for unlikely learning, the scorer.

`PPOArguments` (trainer/ppo.py) and `GRPOArguments` (trainer/grpo.py) each add only what their own step
reads, so neither stage's --help lists a setting it ignores.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from foundation.cli import Checked, UsageError, above, at_least, between, one_of
from foundation.stages import REWARD
from trainer.config import PLANNED_HELP
from trainer.model.decode import DECODE_PATHS, GENERATION_WEIGHTS
from trainer.rl.rewards import (Scorer, builtin, check_spec, describe, load_reward_functions, parse_weights,
                                source_hashes, split_specs)

logger = logging.getLogger(__name__)

HOT_TEMPERATURE = 2.0  # above it, samples are close to random tokens and the policy's gradient is 1/T of its own


def _temperature_rule(name: str, value: float):
    """0 is greedy; a tiny temperature makes every draw the argmax and every log-prob 0: nothing to learn."""
    return None if value == 0 or 0.01 <= value <= 100 else "must be 0 (greedy) or in [0.01, 100]"


def _scripted_reward_rule(name: str, value: str) -> Optional[str]:
    try:
        builtin(value, "--scripted_reward")
    except UsageError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


def _reward_fn_rule(name: str, value: str) -> Optional[str]:
    """The form of each function named (PATH.py:NAME, ...); importing waits for `make_scorer`."""
    if not split_specs(value):
        return "names no function"
    for spec in split_specs(value):
        try:
            check_spec(spec)
        except UsageError as exc:
            return str(exc).replace("--reward_fn ", "", 1)
    return None


@dataclass(frozen=True)
class RolloutArguments(Checked):
    """What an online RL step reads besides its own update: frozen, the step never writes them."""

    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    reward_adapter: Optional[str] = field(default=None, metadata={"help": "Reward adapter + head (frozen scorer; value start)."})
    reward_fn: Optional[str] = field(default=None, metadata={
        "help": "Reward functions, comma-separated: PATH.py:NAME, package.module:NAME or the built-ins keyword:WORD, "
                "length:N, chars:N; TRL's convention (docs/training.md). Summed with the reward adapter's score when "
                "one is set."})
    reward_weights: Optional[str] = field(default=None, metadata={
        "help": "Weights of the --reward_fn functions, comma-separated (default 1 each); the reward adapter weighs 1."})
    reward_timeout_s: float = field(default=600.0, metadata={
        "help": "Seconds one call of a reward function may take; past it the run stops naming the function."})
    scripted_reward: Optional[str] = field(default=None, metadata={
        "help": "A built-in reward function, weight 1: keyword:WORD, length:N or chars:N (as in --reward_fn)."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Prompts per step on each process."})
    rollout_micro_batch_size: int = field(default=8, metadata={"help": PLANNED_HELP.format(
        "Rows per generation / scoring pass", "8")})
    mini_batch_size: int = field(default=4, metadata={"help": "Rows per optimizer step in the update."})
    auto_fit: Optional[bool] = field(default=None, metadata={
        "help": "Plan the settings left auto (rollout_micro_batch_size, micro_batch_size, gradient_checkpointing, "
                "the offloads, generation_weights) from the memory estimate to use memory_budget_gib with a 10%% "
                "margin (profiling/plan.py), logged as a table at start; a value you give is kept. Default: on "
                "with CUDA, off on CPU."})
    decode: str = field(default="eager", metadata={
        "help": "How rollouts decode (trainer/model/decode.py): eager (a KV cache grown per step, each step run "
                "eagerly) or compiled (a full-length KV cache and a torch.compile'd step, replayed as CUDA graphs on "
                "CUDA; the first rollout pays the compilation)."})
    generation_weights: str = field(default="auto", metadata={
        "help": "What a 4-bit base decodes from: quantized (its 4-bit weights), dequantized (a dense copy made for "
                "each rollout, freed after), resident (that copy kept), or auto (the budget planner's pick, "
                "quantized without one)."})
    max_new_tokens: int = field(default=32, metadata={"help": "Response length limit."})
    min_new_tokens: int = field(default=0, metadata={"help": "Fix the response length (= max_new_tokens) for benchmarks."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip."})
    missing_eos_penalty: Optional[float] = field(default=None, metadata={"help": "Subtracted from scores of responses without EOS."})
    eval_prompts: int = field(default=16, metadata={"help": "Held-out prompts for policy-vs-SFT evaluation."})
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of evaluations (same samples each time)."})

    PLANNED = ("rollout_micro_batch_size", "generation_weights")
    SECTION = "rollout"
    IN_SECTION = {**dict.fromkeys(("rollout_micro_batch_size", "auto_fit", "decode", "generation_weights"), "memory"),
                  "cliprange": "method"}
    RULES = {"scripted_reward": _scripted_reward_rule, "reward_fn": _reward_fn_rule, "reward_timeout_s": above(0),
             "rollout_batch_size": at_least(1),
             "rollout_micro_batch_size": at_least(1), "mini_batch_size": at_least(1),
             "max_new_tokens": at_least(1), "min_new_tokens": at_least(0), "temperature": _temperature_rule,
             "top_k": at_least(0), "top_p": between(0, 1), "decode": one_of(*DECODE_PATHS),
             "generation_weights": one_of("auto", *GENERATION_WEIGHTS),
             "cliprange": above(0), "eval_prompts": at_least(0)}

    def reward_sources(self) -> dict[str, str]:
        """The files and modules the reward functions come from, each with a hash of its source."""
        return source_hashes(split_specs(self.reward_fn))

    def check(self) -> None:
        parse_weights(self.reward_weights, len(split_specs(self.reward_fn)))
        if self.min_new_tokens > self.max_new_tokens:
            raise UsageError(f"--min_new_tokens {self.min_new_tokens} exceeds --max_new_tokens {self.max_new_tokens}")
        if self.top_p == 0:
            raise UsageError("--top_p 0 keeps no token: use a value in (0, 1]")


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
