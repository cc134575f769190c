"""Stage 1, SFT: cross-entropy on the assistant completion of hh-rlhf "chosen" dialogues.

    accelerate launch trainer/sft.py --config trainer/configs/sft.yaml [--field value ...]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from trainer.collators import SFTCollator
from trainer.losses import IGNORE_INDEX
from trainer.loop import StepOutput, run_training
from trainer.run import finish_stage, start_run
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import SFTExample, pack_sft, tokenize_sft


@dataclass
class SFTArguments:
    packing: bool = field(default=False, metadata={"help": "Concatenate examples into max_length rows (fewer pad tokens)."})
    eval_batch_size: int = field(default=8, metadata={"help": "Rows per evaluation forward pass."})
    init_adapter: Optional[str] = field(default=None, metadata={"help": "Start from this PEFT adapter instead of a fresh LoRA."})


def rank_shard(items: Sequence, accelerator) -> Sequence:
    """This rank's share of an evaluation set (every item exactly once across ranks)."""
    return items[accelerator.process_index :: accelerator.num_processes]


def completion_nll(model, batch: dict[str, torch.Tensor], adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token NLL of the completion tokens, their count); the LM head runs on those tokens only."""
    logp = model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="logprobs",
                 labels=batch["labels"])
    return -logp.sum(), (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def completion_perplexity(model, examples: Sequence[SFTExample], collate: SFTCollator, batch_size: int,
                          accelerator, adapter: str = "policy", max_batches: int = 0) -> dict[str, float]:
    """Held-out perplexity over completion tokens only, summed over every rank's shard."""
    mine = rank_shard(examples, accelerator)
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i, start in enumerate(range(0, len(mine), batch_size)):
        if max_batches and i >= max_batches:
            break
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start : start + batch_size]).items()}
        loss_sum, count = completion_nll(model, batch, adapter)
        total += torch.stack([loss_sum.double(), count.double()])
    total = accelerator.reduce(total, reduction="sum")
    mean = (total[0] / total[1].clamp(min=1)).item()
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": total[1].item()}


class SFTStage:
    name = "sft"
    trainable_adapters = ["policy"]

    def __init__(self, eval_examples: Sequence[SFTExample], collate: SFTCollator, eval_batch_size: int, eval_batches: int):
        self.eval_examples, self.collate = eval_examples, collate
        self.eval_batch_size, self.eval_batches = eval_batch_size, eval_batches

    def compute_loss(self, model, batch: dict[str, torch.Tensor]) -> StepOutput:
        loss_sum, count = completion_nll(model, batch, "policy")
        loss = loss_sum / count.clamp(min=1)
        return StepOutput(loss, {"loss": loss.detach()}, tokens=int(batch["attention_mask"].sum()))

    def evaluate(self, model, accelerator) -> dict[str, float]:
        return completion_perplexity(model, self.eval_examples, self.collate, self.eval_batch_size, accelerator,
                                     max_batches=self.eval_batches)


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(SFTArguments, argv, stage="sft")
    tok, data_args, args = ctx.tokenizer, ctx.data_args, ctx.stage_args
    train, _ = tokenize_sft(ctx.splits.sft, tok, data_args)
    held_out, _ = tokenize_sft(ctx.splits.eval, tok, data_args)
    if args.packing:
        train = pack_sft(train, data_args.max_length)
    model = build_shared_model(ctx.model_args, [AdapterSpec("policy", trainable=True, init_from=args.init_adapter)],
                               vocab_size=len(tok), device=ctx.accelerator.device)
    collate = SFTCollator(tok.pad_token_id)
    stage = SFTStage(held_out, collate, args.eval_batch_size, ctx.train_args.eval_batches)
    run_training(stage, model, train, collate, ctx.train_args, ctx.accelerator, config=ctx.config(),
                 resume_from=ctx.resume_from)
    return finish_stage(ctx, "sft", model, "policy", train_examples=len(train), eval_examples=len(held_out))


if __name__ == "__main__":
    main()
