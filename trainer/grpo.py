"""Critic-free online RL on ONE shared base: GRPO or RLOO, no value model.

Each step (`trainer.rl.online.rl_step` with `trainer.rl.algorithms`' GRPO or RLOO) samples `num_generations` responses per prompt, scores them,
turns each group's rewards into advantages (GRPO: z-scores; RLOO: leave-one-out) and takes clipped ratio
steps, the KL to the reference a k3 loss term (GRPO) or a reward penalty (RLOO).

    accelerate launch trainer/grpo.py --config trainer/configs/grpo.yaml [--advantage rloo ...]
"""

from __future__ import annotations

from typing import Optional

from foundation.cli import run
from foundation.settings import GRPOArguments
from foundation.stages import POLICY, REFERENCE, REWARD
from trainer.data.tokenization import tokenize_prompts
from trainer.engine.setup import RunContext, finish_stage, require_rows, start_run
from trainer.rl.algorithms.grpo import GRPO
from trainer.rl.algorithms.rloo import RLOO
from trainer.rl.online import RLState, build_online_model, train_online
from trainer.rl.rewards import Scorer
from trainer.rl.settings import make_scorer, require_scorer, warn_if_learning_unlikely


def check_settings(args: GRPOArguments) -> None:
    """What GRPO needs besides single fields (its batch sizes: `trainer.engine.settle`): a scorer."""
    require_scorer(args, "GRPO")
    warn_if_learning_unlikely(args)


def build_model(ctx: RunContext):
    """Policy and reference from the SFT adapter, the reward adapter + head (if scored by it); LoRA
    dropout off, as in PPO (old log-probs are taken in eval mode)."""
    args = ctx.stage_args
    sources = {POLICY: args.sft_adapter, REFERENCE: args.sft_adapter, REWARD: args.reward_adapter}
    without = ((REWARD,) if args.reward_adapter is None else ()) + ((REFERENCE,) if args.beta == 0 else ())
    return build_online_model(ctx, "grpo", sources, without=without)


LOG_KEYS = ["reward", "reward_std", "kl", "clip_ratio", "completions/mean_length", "perf/rollout_s", "perf/update_s"]


def train(ctx: RunContext, model, prompts, held_out, scorer: Scorer) -> RLState:
    """Run GRPO or RLOO (`--advantage`) on `model` for train_args.max_steps steps; returns the state it ended in."""
    args = ctx.stage_args
    algorithm = RLOO(args) if args.advantage == "rloo" else GRPO(args)
    return train_online(ctx, "grpo", model, algorithm, [POLICY], prompts, held_out, scorer, LOG_KEYS)


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(GRPOArguments, argv, stage="grpo")
    args = ctx.stage_args
    check_settings(args)
    prompts, _ = tokenize_prompts(ctx.splits.ppo, ctx.tokenizer, ctx.data_args)
    held_out, _ = tokenize_prompts(ctx.splits.eval[: args.eval_prompts], ctx.tokenizer, ctx.data_args)
    require_rows(prompts, "GRPO prompts", args.rollout_batch_size, ctx.data_args)
    scorer = make_scorer(args, ctx.tokenizer)  # reward functions imported before the model loads: a bad one fails fast
    model = build_model(ctx)
    state = train(ctx, model, prompts, held_out, scorer)
    scorer.close()  # the reward functions' worker, if any: done with them
    return finish_stage(ctx, "grpo", model, POLICY, prompts=len(prompts), update_micro_batch=state.micro_batch_size)


ARGUMENTS = GRPOArguments  # the `stage:` section of this stage's config

if __name__ == "__main__":
    run(main)
