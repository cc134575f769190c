"""The settings PPO and GRPO share - adapters, rollout sizes, sampling, clipping, evaluation, the scorer - and
what both do with them at start: the checks, the warning for unlikely learning, the scorer.

`PPOArguments` (trainer/ppo.py) and `GRPOArguments` (trainer/grpo.py) each add only what their own step
reads, so neither stage's --help lists a setting it ignores.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from foundation.cli import Checked, UsageError, above, at_least, between, one_of
from trainer.rl.rollout import DECODE_PATHS, RewardModelScorer, ScriptedScorer, parse_scripted_reward

logger = logging.getLogger(__name__)

HOT_TEMPERATURE = 2.0  # above it, samples are close to random tokens and the policy's gradient is 1/T of its own


def _scripted_reward_rule(name: str, value: str) -> Optional[str]:
    try:
        parse_scripted_reward(value)
    except UsageError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


@dataclass(frozen=True)
class RolloutArguments(Checked):
    """What an online RL step reads besides its own update: frozen, the step never writes them."""

    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    reward_adapter: Optional[str] = field(default=None, metadata={"help": "Reward adapter + head (frozen scorer; value start)."})
    scripted_reward: Optional[str] = field(default=None, metadata={"help": "Instead of a reward model: keyword:WORD, length:N or chars:N."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Prompts per step on each process."})
    rollout_micro_batch_size: int = field(default=8, metadata={"help": "Rows per generation / scoring pass."})
    mini_batch_size: int = field(default=4, metadata={"help": "Rows per optimizer step in the update."})
    auto_fit: Optional[bool] = field(default=None, metadata={
        "help": "Plan rollout_micro_batch_size, micro_batch_size and gradient_checkpointing from the memory estimate "
                "to use memory_budget_gib with a 10%% margin (profiling/plan.py), logged as a table at start. "
                "Default: on with CUDA, off on CPU."})
    decode: str = field(default="eager", metadata={
        "help": "How generation runs its decode steps: eager (transformers' dynamic KV cache), static (a KV cache "
                "allocated once at full length) or compiled (the static cache and a torch.compile'd decode step; "
                "the first rollout pays the compilation). Each reads the policy's old log-probs from the logits "
                "it sampled from."})
    max_new_tokens: int = field(default=32, metadata={"help": "Response length limit."})
    min_new_tokens: int = field(default=0, metadata={"help": "Fix the response length (= max_new_tokens) for benchmarks."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip."})
    missing_eos_penalty: Optional[float] = field(default=None, metadata={"help": "Subtracted from scores of responses without EOS."})
    eval_prompts: int = field(default=16, metadata={"help": "Held-out prompts for policy-vs-SFT evaluation."})
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of evaluations (same samples each time)."})

    RULES = {"scripted_reward": _scripted_reward_rule, "rollout_batch_size": at_least(1),
             "rollout_micro_batch_size": at_least(1), "mini_batch_size": at_least(1),
             "max_new_tokens": at_least(1), "min_new_tokens": at_least(0), "temperature": at_least(0),
             "top_k": at_least(0), "top_p": between(0, 1), "decode": one_of(*DECODE_PATHS),
             "cliprange": above(0), "eval_prompts": at_least(0)}

    def check(self) -> None:
        if self.min_new_tokens > self.max_new_tokens:
            raise UsageError(f"--min_new_tokens {self.min_new_tokens} exceeds --max_new_tokens {self.max_new_tokens}")
        if self.top_p == 0:
            raise UsageError("--top_p 0 keeps no token: use a value in (0, 1]")
        if math.isinf(self.temperature):
            raise UsageError("--temperature inf samples every token alike and scores them alike: the policy gets no "
                             "gradient and can never learn; use a finite temperature (1.0 is usual)")


def require_scorer(args: RolloutArguments, stage: str) -> None:
    if args.reward_adapter is None and args.scripted_reward is None:
        raise UsageError(f"{stage} needs a scorer: pass --reward_adapter DIR (from trainer/reward.py) or "
                         "--scripted_reward keyword:WORD|length:N|chars:N")


def warn_if_learning_unlikely(args: RolloutArguments) -> None:
    """One warning at start for sampling under which the policy can learn, but hardly."""
    if args.temperature > HOT_TEMPERATURE:
        logger.warning("--temperature %s: responses are close to random tokens and the policy's log-probs at that "
                       "temperature move %.3gx as fast as at 1.0, so learning is unlikely (1.0 is usual)",
                       args.temperature, 1 / args.temperature)


def make_scorer(args: RolloutArguments, tokenizer):
    """The scripted reward if one is set, else the frozen reward adapter + head."""
    return ScriptedScorer(args.scripted_reward, tokenizer) if args.scripted_reward else RewardModelScorer()
