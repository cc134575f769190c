"""Stage 1, SFT: the `policy` adapter learns hh-rlhf's chosen replies, with the loss on completion
tokens only (the prompt is context, never a target). Held-out perplexity is over completion tokens.

    accelerate launch trainer/sft.py --config trainer/configs/sft.yaml [--field value ...]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from foundation.cli import Checked, run
from foundation.stages import POLICY
from trainer.data.collators import SFTCollator
from trainer.data.tokenization import IGNORE_INDEX, SFTExample, pack_sft, tokenize_sft
from trainer.engine.batches import eval_batches
from trainer.engine.harness import Harness, StepOutput, supervised_step
from trainer.engine.setup import finish_stage, start_run
from trainer.losses import step_mean_share
from trainer.model.shared_base import stage_specs
from trainer.run_report import bootstrap_perplexity_interval


@dataclass
class SFTArguments(Checked):
    packing: bool = field(default=False, metadata={"help": "Concatenate examples into max_length rows (fewer pad tokens)."})
    init_adapter: Optional[str] = field(default=None, metadata={"help": "Start from this PEFT adapter instead of a fresh LoRA."})


def completion_nll(model, batch: dict[str, torch.Tensor], adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token NLL of the completion tokens, their count); the LM head runs on those tokens only."""
    nll, count = completion_nll_rows(model, batch, adapter)
    return nll.sum(), count.sum()


def completion_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Completion tokens of a batch: the tokens SFT's loss is a mean over."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def completion_nll_rows(model, batch: dict[str, torch.Tensor], adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (B,): the summed next-token NLL of its completion tokens, and their count."""
    logp = model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="logprobs",
                 labels=batch["labels"])
    return -logp.sum(dim=1), (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)


@torch.no_grad()
def completion_perplexity(model, examples: Sequence[SFTExample], collate: SFTCollator, batch_size: int,
                          accelerator, adapter: str = POLICY, max_batches: int = 0,
                          progress: bool = True, interval: bool = False) -> dict:
    """Held-out perplexity over completion tokens only, summed over every rank's share; with `interval`, also
    its 95% bootstrap interval over the rows ("perplexity_ci95")."""
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    rows: list[tuple[float, int]] = []
    for batch, real in eval_batches(examples, collate, batch_size, accelerator, max_batches, "perplexity", progress):
        nll, count = completion_nll_rows(model, batch, adapter)
        if real:
            total += torch.stack([nll.double().sum(), count.double().sum()])
            if interval:
                rows += zip(nll.double().tolist(), count.tolist())
    total = accelerator.reduce(total, reduction="sum")
    mean = (total[0] / total[1].clamp(min=1)).item()
    out = {"loss": mean, "perplexity": math.exp(mean), "tokens": total[1].item()}
    if interval:
        from accelerate.utils import gather_object

        nll_rows, count_rows = zip(*gather_object(rows))  # every rank's rows, on every rank
        out["perplexity_ci95"] = list(bootstrap_perplexity_interval(nll_rows, count_rows))
    return out


ARGUMENTS = SFTArguments  # the `stage:` section of this stage's config


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(SFTArguments, argv, stage="sft")
    tok, data_args, targs = ctx.tokenizer, ctx.data_args, ctx.train_args
    train, _ = tokenize_sft(ctx.splits.sft, tok, data_args)
    held_out, _ = tokenize_sft(ctx.splits.eval, tok, data_args)
    if ctx.stage_args.packing:
        train = pack_sft(train, data_args.max_length)
    ctx.require_batch(train, "SFT training set")
    model = ctx.build_model(stage_specs("sft", {POLICY: ctx.stage_args.init_adapter}))
    collate = SFTCollator(tok.pad_token_id)

    def compute_loss(batch: dict[str, torch.Tensor], normaliser: float) -> StepOutput:
        loss_sum, _ = completion_nll(harness.engine.model, batch, POLICY)
        return StepOutput(step_mean_share(loss_sum, normaliser), tokens=int(batch["attention_mask"].sum()))

    def evaluate(engine) -> dict[str, float]:
        if not held_out:  # every held-out row dropped (too long): no figures, not a perplexity of 1 over none
            return {}
        return completion_perplexity(engine.model, held_out, collate, targs.eval_batch_size, ctx.accelerator,
                                     max_batches=targs.eval_batches, progress=targs.progress_bar)

    harness = Harness(ctx, model, "sft", [POLICY], train, collate, evaluate,
                      by_length=True,
                      log_keys=["train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/peak_gb"])
    harness.train(supervised_step(harness.engine, compute_loss, targs.gradient_accumulation_steps, completion_tokens))
    return finish_stage(ctx, "sft", model, POLICY, train_examples=len(train), eval_examples=len(held_out))


if __name__ == "__main__":
    run(main)
