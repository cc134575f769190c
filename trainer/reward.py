"""Stage 2, reward model: Bradley-Terry ranking loss -log sigmoid(r_chosen - r_rejected).

The `reward` adapter (warm-started from the SFT adapter) and its scalar head score chosen and
rejected in ONE forward pass: the pair collator stacks the B chosen rows over the B rejected rows.

    accelerate launch trainer/reward.py --config trainer/configs/reward.yaml [--sft_adapter DIR]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from accelerate.utils import gather_object

from foundation.cli import Checked, run
from foundation.stages import REWARD
from trainer.data.collators import PairCollator, pair_collator, pairs_in
from trainer.data.tokenization import PairExample, tokenize_pairs
from trainer.engine.batches import eval_batches
from trainer.engine.harness import Harness, StepOutput, supervised_step
from trainer.engine.setup import finish_stage, start_run
from trainer.losses import last_token_values, pairwise_ranking_losses, ranking_stats, step_mean_share
from trainer.model.shared_base import stage_specs


@dataclass
class RewardArguments(Checked):
    sft_adapter: Optional[str] = field(
        default=None, metadata={"help": "SFT adapter folder to warm-start the reward adapter from (None: fresh LoRA)."})


def pair_rewards(model, batch: dict[str, torch.Tensor], adapter: str = REWARD) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the chosen and rejected completions of a pair batch, from one forward pass: over B rows of
    prompt + chosen + rejected (SharedPromptPairCollator), or over 2B rows, chosen over rejected (PairCollator)."""
    if "segments" in batch:
        return model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="pair_scores",
                     segments=batch["segments"])
    scores = model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="scores")
    rewards = last_token_values(scores, batch["attention_mask"])
    return rewards.chunk(2)


@torch.no_grad()
def reward_accuracy(model, examples: Sequence[PairExample], collate: PairCollator, batch_size: int, accelerator,
                    adapter: str = REWARD, max_batches: int = 0, progress: bool = True) -> dict[str, float]:
    """Held-out pairwise accuracy, margin and chosen / rejected reward statistics over all ranks."""
    chosen, rejected = [], []
    for batch, real in eval_batches(examples, collate, batch_size, accelerator, max_batches, "accuracy", progress):
        rc, rr = pair_rewards(model, batch, adapter)
        if real:
            chosen += rc.float().tolist()
            rejected += rr.float().tolist()
    # Shares differ in size by up to one pair: gather Python lists, not equal-shape tensors.
    rc, rr = torch.tensor(gather_object(chosen)), torch.tensor(gather_object(rejected))
    stats = ranking_stats(rc, rr)
    return {"accuracy": float(stats["accuracy"]), "margin": float(stats["margin"]), "pairs": float(rc.numel()),
            "chosen_mean": rc.mean().item(), "chosen_std": rc.std().item(),
            "rejected_mean": rr.mean().item(), "rejected_std": rr.std().item()}


ARGUMENTS = RewardArguments  # the `stage:` section of this stage's config


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(RewardArguments, argv, stage="reward")
    tok, data_args, targs = ctx.tokenizer, ctx.data_args, ctx.train_args
    train, _ = tokenize_pairs(ctx.splits.reward, tok, data_args)
    held_out, _ = tokenize_pairs(ctx.splits.eval, tok, data_args)
    ctx.require_batch(train, "reward training pairs")
    model = ctx.build_model(stage_specs("reward", {REWARD: ctx.stage_args.sft_adapter}))
    collate = pair_collator(tok.pad_token_id, targs.share_pair_prompts, model)

    def compute_loss(batch: dict[str, torch.Tensor], normaliser: float) -> StepOutput:
        rc, rr = pair_rewards(harness.engine.model, batch)
        loss = step_mean_share(pairwise_ranking_losses(rc, rr), normaliser)
        stats = ranking_stats(rc.detach(), rr.detach())
        return StepOutput(loss, {"accuracy": stats["accuracy"], "margin": stats["margin"]},
                          tokens=int(batch["attention_mask"].sum()))

    def evaluate(engine) -> dict[str, float]:
        return reward_accuracy(engine.model, held_out, collate, targs.eval_batch_size, ctx.accelerator,
                               max_batches=targs.eval_batches, progress=targs.progress_bar)

    harness = Harness(ctx, model, "reward", [REWARD], train, collate, evaluate,
                      by_length=True,
                      log_keys=["train/loss", "train/accuracy", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                                "perf/peak_gb"])
    harness.train(supervised_step(harness.engine, compute_loss, targs.gradient_accumulation_steps, pairs_in))
    return finish_stage(ctx, "reward", model, REWARD, train_pairs=len(train), eval_pairs=len(held_out))


if __name__ == "__main__":
    run(main)
