"""PPO on ONE shared 4-bit base: policy, reference, value and reward are LoRA adapters.

Each step (`trainer.rl.online.rl_step` with `trainer.rl.algorithms.ppo.PPO`) samples with `policy`, scores
with `reward` and / or reward functions (`--reward_fn`), takes the KL to `reference` and values from `value`,
computes GAE advantages, runs clipped policy and value updates and adapts the KL coefficient; every
`eval_every` steps the policy and SFT answer held-out prompts.

    accelerate launch trainer/ppo.py --config trainer/configs/ppo.yaml [--field value ...]
"""

from __future__ import annotations

import logging
from typing import Optional

from foundation.cli import run
from foundation.settings import PPOArguments
from foundation.stages import POLICY, REFERENCE, REWARD, VALUE
from trainer.data.tokenization import tokenize_prompts
from trainer.engine.setup import RunContext, finish_stage, require_rows, start_run
from trainer.rl.algorithms.ppo import PPO
from trainer.rl.online import RLState, build_online_model, train_online
from trainer.rl.rewards import Scorer
from trainer.rl.settings import make_scorer, require_scorer, warn_if_learning_unlikely

logger = logging.getLogger(__name__)


def check_settings(args: PPOArguments) -> None:
    """What PPO needs besides single fields (its batch sizes: `trainer.engine.settle`): a scorer."""
    require_scorer(args, "PPO")
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
    args = ctx.stage_args
    sources = {POLICY: args.sft_adapter, REFERENCE: args.sft_adapter, VALUE: args.reward_adapter,
               REWARD: args.reward_adapter}
    return build_online_model(ctx, "ppo", sources, without=(REWARD,) if args.reward_adapter is None else ())


ARGUMENTS = PPOArguments  # the `stage:` section of this stage's config


LOG_KEYS = ["objective/scores", "objective/kl", "objective/kl_coef", "policy/clipfrac_avg", "val/response_length",
            "perf/rollout_s", "perf/generate_tokens_per_s", "perf/update_s", "perf/peak_gb"]


def train(ctx: RunContext, model, prompts, held_out, scorer: Scorer) -> RLState:
    """Run PPO on `model` for train_args.max_steps steps in the harness; returns the state it ended in."""
    return train_online(ctx, "ppo", model, PPO(ctx.stage_args), [POLICY, VALUE], prompts, held_out, scorer, LOG_KEYS)


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(PPOArguments, argv, stage="ppo")
    args = ctx.stage_args
    check_settings(args)
    prompts, _ = tokenize_prompts(ctx.splits.ppo, ctx.tokenizer, ctx.data_args)
    held_out, _ = tokenize_prompts(ctx.splits.eval[: args.eval_prompts], ctx.tokenizer, ctx.data_args)
    require_rows(prompts, "PPO prompts", args.rollout_batch_size, ctx.data_args)
    scorer = make_scorer(args, ctx.tokenizer)  # reward functions imported before the model loads: a bad one fails fast
    model = build_model(ctx)
    state = train(ctx, model, prompts, held_out, scorer)
    scorer.close()  # the reward functions' worker, if any: done with them
    return finish_stage(ctx, "ppo", model, POLICY, prompts=len(prompts), update_micro_batch=state.micro_batch_size)


if __name__ == "__main__":
    run(main)
