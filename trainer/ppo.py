"""Stage 3, PPO on ONE shared 4-bit base: policy, reference, value and reward are LoRA adapters.

Each step (`trainer.rl.ppo_step.ppo_step`): sample responses to a batch of prompts with `policy`,
score them with `reward`, take per-token KL against `reference` (the frozen SFT adapter) and values
from `value`, compute GAE advantages, run clipped policy and value updates over shuffled minibatches,
and adapt the KL coefficient. Every `eval_every` steps the policy and SFT answer held-out prompts
side by side (`trainer.rl.policy_eval`).

    accelerate launch trainer/ppo.py --config trainer/configs/ppo.yaml [--field value ...]
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from foundation.cli import Checked, UsageError, above, at_least, between, one_of, run
from foundation.stages import POLICY, REFERENCE, REWARD, VALUE
from trainer.config import PROJECT_ROOT
from trainer.data.collators import PromptCollator
from trainer.data.tokenization import tokenize_prompts
from trainer.engine.harness import Harness, StepResult
from trainer.engine.setup import RunContext, finish_stage, require_rows, start_run
from trainer.losses import KL_ESTIMATORS
from trainer.model.shared_base import build_shared_model, stage_specs
from trainer.rl.policy_eval import policy_vs_reference
from trainer.rl.ppo_step import PPOState, ppo_step
from trainer.rl.rollout import DECODE_PATHS, RewardModelScorer, Sampling, ScriptedScorer, parse_scripted_reward

logger = logging.getLogger(__name__)


def _scripted_reward_rule(name: str, value: str) -> Optional[str]:
    try:
        parse_scripted_reward(value)
    except UsageError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


@dataclass(frozen=True)
class PPOArguments(Checked):
    """PPO's settings, frozen: the step reads them, never writes them (what changes is in PPOState)."""

    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    reward_adapter: Optional[str] = field(default=None, metadata={"help": "Reward adapter + head (frozen scorer; value start)."})
    scripted_reward: Optional[str] = field(default=None, metadata={"help": "Instead of a reward model: keyword:WORD, length:N or chars:N."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Prompts per PPO step on each process."})
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
    ppo_epochs: int = field(default=2, metadata={"help": "Passes over each rollout batch."})
    max_new_tokens: int = field(default=32, metadata={"help": "Response length limit."})
    min_new_tokens: int = field(default=0, metadata={"help": "Fix the response length (= max_new_tokens) for benchmarks."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    kl_estimator: str = field(default="k1", metadata={"help": "'k1' (log-ratio), 'k2' or 'k3' (unbiased, non-negative)."})
    init_kl_coef: float = field(default=0.05, metadata={"help": "KL penalty beta (initial, if adaptive)."})
    adaptive_kl: bool = field(default=False, metadata={"help": "Adapt beta toward target_kl (Ziegler et al.)."})
    target_kl: float = field(default=6.0, metadata={"help": "Target KL per response for the adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Adaptive controller horizon (rollouts)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip around the rollout values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss weight."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus weight."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards before GAE."})
    missing_eos_penalty: Optional[float] = field(default=None, metadata={"help": "Subtracted from scores of responses without EOS."})
    eval_prompts: int = field(default=16, metadata={"help": "Held-out prompts for policy-vs-SFT evaluation."})
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of evaluations (same samples each time)."})
    train_missing_stages: bool = field(
        default=False, metadata={"help": "If sft_adapter / reward_adapter (.../STAGE/adapter) do not exist yet, "
                                 "train them first with trainer/configs/STAGE.yaml (end to end from the base model)."})

    RULES = {"scripted_reward": _scripted_reward_rule, "rollout_batch_size": at_least(1),
             "rollout_micro_batch_size": at_least(1), "mini_batch_size": at_least(1), "ppo_epochs": at_least(1),
             "max_new_tokens": at_least(1), "min_new_tokens": at_least(0), "temperature": at_least(0),
             "top_k": at_least(0), "top_p": between(0, 1), "decode": one_of(*DECODE_PATHS),
             "kl_estimator": one_of(*KL_ESTIMATORS),
             "init_kl_coef": at_least(0), "target_kl": above(0), "kl_horizon": at_least(1), "gamma": between(0, 1),
             "lam": between(0, 1), "cliprange": above(0), "cliprange_value": above(0), "vf_coef": at_least(0),
             "entropy_coef": at_least(0), "eval_prompts": at_least(0)}

    def check(self) -> None:
        if self.min_new_tokens > self.max_new_tokens:
            raise UsageError(f"--min_new_tokens {self.min_new_tokens} exceeds --max_new_tokens {self.max_new_tokens}")
        if self.top_p == 0:
            raise UsageError("--top_p 0 keeps no token: use a value in (0, 1]")
        if math.isinf(self.temperature):
            raise UsageError("--temperature inf samples every token alike and scores them alike: the policy gets no "
                             "gradient and can never learn; use a finite temperature (1.0 is usual)")


HOT_TEMPERATURE = 2.0  # above it, samples are close to random tokens and the policy's gradient is 1/T of its own


def warn_if_learning_unlikely(args: PPOArguments) -> None:
    """One warning at start for sampling under which the policy can learn, but hardly."""
    if args.temperature > HOT_TEMPERATURE:
        logger.warning("--temperature %s: responses are close to random tokens and the policy's log-probs at that "
                       "temperature move %.3gx as fast as at 1.0, so learning is unlikely (1.0 is usual)",
                       args.temperature, 1 / args.temperature)


def check_settings(args: PPOArguments, micro: int) -> None:
    """What PPO needs besides single fields: a scorer, and batch sizes that divide each other."""
    if args.reward_adapter is None and args.scripted_reward is None:
        raise UsageError("PPO needs a scorer: pass --reward_adapter DIR (from trainer/reward.py) or "
                         "--scripted_reward keyword:WORD|length:N")
    if args.rollout_batch_size % args.mini_batch_size or args.mini_batch_size % micro:
        raise UsageError(f"--rollout_batch_size ({args.rollout_batch_size}) must be a multiple of --mini_batch_size "
                         f"({args.mini_batch_size}), and that a multiple of --micro_batch_size ({micro})")
    truncating = [f"{k}={v}" for k, v, off in (("top_k", args.top_k, 0), ("top_p", args.top_p, 1.0),
                                               ("min_new_tokens", args.min_new_tokens, 0)) if v != off]
    if truncating:
        logger.warning("PPO scores the untruncated policy at temperature %s (as TRL does), while %s reshape the "
                       "distribution responses are sampled from: ratios and KL are then approximate",
                       args.temperature, ", ".join(truncating))
    if args.temperature == 0:
        logger.warning("--temperature 0 (greedy): one fixed response per prompt and no exploration; PPO can only "
                       "push that response up or down, so learning is unlikely (1.0 is usual)")
    warn_if_learning_unlikely(args)


def build_model(ctx: RunContext):
    """The four adapters on one base, with LoRA dropout off: rollout log-probs are taken in eval mode, so
    dropout in the update would make the first policy ratio differ from 1."""
    model_args, args = ctx.model_args, ctx.stage_args
    if model_args.lora_dropout:
        logger.info("PPO trains without LoRA dropout: lora_dropout %s -> 0", model_args.lora_dropout)
        model_args = replace(model_args, lora_dropout=0.0)
    sources = {POLICY: args.sft_adapter, REFERENCE: args.sft_adapter, VALUE: args.reward_adapter,
               REWARD: args.reward_adapter}
    specs = stage_specs("ppo", sources, without=(REWARD,) if args.reward_adapter is None else ())
    return build_shared_model(model_args, specs, vocab_size=len(ctx.tokenizer), device=ctx.accelerator.device,
                              quant_storage=ctx.quant_storage(model_args))


def make_scorer(args: PPOArguments, tokenizer):
    return ScriptedScorer(args.scripted_reward, tokenizer) if args.scripted_reward else RewardModelScorer()


def train_missing_stages(argv: Optional[list[str]], arguments: type = None) -> None:
    """Produce absent SFT / reward adapters through the pipeline's stage runner, so the default PPO (or
    GRPO: `arguments` is the stage's argument class) config runs end to end on a fresh checkout."""
    from trainer.config import parse_config
    from trainer.pipeline import train_stages_into

    argv = list(sys.argv[1:] if argv is None else argv)
    model_args, _, _, args = parse_config(arguments or PPOArguments, argv)
    if not args.train_missing_stages:
        return
    # The stage configs beside the PPO config (a recipe folder), else the demo ones.
    folder = Path(argv[argv.index("--config") + 1]).parent if "--config" in argv else PROJECT_ROOT / "trainer" / "configs"
    train_stages_into(folder, {"sft": args.sft_adapter, "reward": args.reward_adapter},
                      ["--model_name_or_path", model_args.model_name_or_path])


ARGUMENTS = PPOArguments  # the `stage:` section of this stage's config


def train(ctx: RunContext, model, prompts, held_out) -> PPOState:
    """Run PPO on `model` for train_args.max_steps steps in the harness; returns the state it ended in."""
    args, targs, tok = ctx.stage_args, ctx.train_args, ctx.tokenizer
    scorer = make_scorer(args, tok)
    state = PPOState.start(args, targs.micro_batch_size, targs.seed)

    def evaluate() -> dict[str, float]:
        return policy_vs_reference(harness.engine.raw, held_out, Sampling.of(args), scorer, tok.eos_token_id,
                                   tok.pad_token_id, args.rollout_micro_batch_size, args.eval_seed, ctx.accelerator,
                                   POLICY, REFERENCE, progress=targs.progress_bar) or {}

    def step(step_number: int, batches) -> StepResult:
        return ppo_step(harness.engine, next(batches), args, state, scorer, tok.eos_token_id, tok.pad_token_id)

    harness = Harness(ctx, model, "ppo", [POLICY, VALUE], prompts, PromptCollator(tok.pad_token_id),
                      args.rollout_batch_size, evaluate, extra_state=state,
                      accumulation_steps=args.mini_batch_size // targs.micro_batch_size,
                      log_keys=["objective/scores", "objective/kl", "objective/kl_coef", "policy/clipfrac_avg",
                                "val/response_length", "perf/rollout_s", "perf/generate_tokens_per_s",
                                "perf/update_s", "perf/peak_gb"])
    harness.train(step)
    if state.micro_batch_size != targs.micro_batch_size:
        logger.warning("the update settled on micro-batch %d (asked for %d) after running out of memory",
                       state.micro_batch_size, targs.micro_batch_size)
    return state


def main(argv: Optional[list[str]] = None) -> dict:
    train_missing_stages(argv)
    ctx = start_run(PPOArguments, argv, stage="ppo")
    args = ctx.stage_args
    check_settings(args, ctx.train_args.micro_batch_size)
    prompts, _ = tokenize_prompts(ctx.splits.ppo, ctx.tokenizer, ctx.data_args)
    held_out, _ = tokenize_prompts(ctx.splits.eval[: args.eval_prompts], ctx.tokenizer, ctx.data_args)
    require_rows(prompts, "PPO prompts", args.rollout_batch_size, ctx.data_args)
    model = build_model(ctx)
    state = train(ctx, model, prompts, held_out)
    return finish_stage(ctx, "ppo", model, POLICY, prompts=len(prompts), update_micro_batch=state.micro_batch_size)


if __name__ == "__main__":
    run(main)
