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

from trainer.collators import PairCollator
from trainer.losses import last_token_values, pairwise_ranking_loss, ranking_stats
from trainer.loop import StepOutput, run_training
from trainer.run import finish_stage, start_run
from trainer.sft import rank_shard
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import PairExample, tokenize_pairs


@dataclass
class RewardArguments:
    sft_adapter: Optional[str] = field(
        default=None, metadata={"help": "SFT adapter folder to warm-start the reward adapter from (None: fresh LoRA)."})
    eval_batch_size: int = field(default=8, metadata={"help": "Pairs per evaluation forward pass."})


def pair_rewards(model, batch: dict[str, torch.Tensor], adapter: str = "reward") -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the chosen and rejected rows of a pair batch, from one forward pass over all 2B rows."""
    scores = model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="scores")
    rewards = last_token_values(scores, batch["attention_mask"])
    return rewards.chunk(2)


@torch.no_grad()
def reward_accuracy(model, examples: Sequence[PairExample], collate: PairCollator, batch_size: int, accelerator,
                    adapter: str = "reward", max_batches: int = 0) -> dict[str, float]:
    """Held-out pairwise accuracy, margin and chosen / rejected reward statistics over all ranks."""
    mine = rank_shard(examples, accelerator)
    chosen, rejected = [], []
    for i, start in enumerate(range(0, len(mine), batch_size)):
        if max_batches and i >= max_batches:
            break
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start : start + batch_size]).items()}
        rc, rr = pair_rewards(model, batch, adapter)
        chosen.append(rc.float())
        rejected.append(rr.float())
    # Shards differ in size by up to one pair: gather Python lists, not equal-shape tensors.
    rc = torch.tensor(gather_object(torch.cat(chosen).tolist() if chosen else []))
    rr = torch.tensor(gather_object(torch.cat(rejected).tolist() if rejected else []))
    stats = ranking_stats(rc, rr)
    return {"accuracy": float(stats["accuracy"]), "margin": float(stats["margin"]), "pairs": float(rc.numel()),
            "chosen_mean": rc.mean().item(), "chosen_std": rc.std().item(),
            "rejected_mean": rr.mean().item(), "rejected_std": rr.std().item()}


class RewardStage:
    name = "reward"
    trainable_adapters = ["reward"]

    def __init__(self, eval_examples: Sequence[PairExample], collate: PairCollator, eval_batch_size: int, eval_batches: int):
        self.eval_examples, self.collate = eval_examples, collate
        self.eval_batch_size, self.eval_batches = eval_batch_size, eval_batches

    def compute_loss(self, model, batch: dict[str, torch.Tensor]) -> StepOutput:
        rc, rr = pair_rewards(model, batch)
        loss = pairwise_ranking_loss(rc, rr)
        stats = ranking_stats(rc.detach(), rr.detach())
        return StepOutput(loss, {"loss": loss.detach(), "accuracy": stats["accuracy"], "margin": stats["margin"]},
                          tokens=int(batch["attention_mask"].sum()))

    def evaluate(self, model, accelerator) -> dict[str, float]:
        return reward_accuracy(model, self.eval_examples, self.collate, self.eval_batch_size, accelerator,
                               max_batches=self.eval_batches)


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(RewardArguments, argv, stage="reward")
    tok, data_args, args = ctx.tokenizer, ctx.data_args, ctx.stage_args
    train, _ = tokenize_pairs(ctx.splits.reward, tok, data_args)
    held_out, _ = tokenize_pairs(ctx.splits.eval, tok, data_args)
    spec = AdapterSpec("reward", trainable=True, init_from=args.sft_adapter, head=True)
    model = build_shared_model(ctx.model_args, [spec], vocab_size=len(tok), device=ctx.accelerator.device)
    collate = PairCollator(tok.pad_token_id)
    stage = RewardStage(held_out, collate, args.eval_batch_size, ctx.train_args.eval_batches)
    run_training(stage, model, train, collate, ctx.train_args, ctx.accelerator, config=ctx.config(),
                 resume_from=ctx.resume_from)
    return finish_stage(ctx, "reward", model, "reward", train_pairs=len(train), eval_pairs=len(held_out))


if __name__ == "__main__":
    main()
