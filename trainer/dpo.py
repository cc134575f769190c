"""DPO, the one-stage alternative to reward model + PPO, on the same shared base.

`policy` (trainable, from the SFT adapter) and `reference` (frozen copy of it) score chosen and
rejected completions in one forward pass each over the stacked 2B-row pair batch.

    accelerate launch trainer/dpo.py --config trainer/configs/dpo.yaml [--sft_adapter DIR]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from accelerate.utils import gather_object

from foundation.cli import Checked, UsageError, between, one_of, run
from foundation.stages import POLICY, REFERENCE
from trainer.data.collators import PairCollator, pair_collator, pairs_in
from trainer.data.tokenization import PairExample, tokenize_pairs
from trainer.engine.batches import eval_batches
from trainer.engine.harness import Harness, StepOutput, supervised_step
from trainer.engine.setup import finish_stage, start_run
from trainer.losses import DPO_LOSS_TYPES, dpo_loss, step_mean_share
from trainer.model.shared_base import stage_specs


@dataclass
class DPOArguments(Checked):
    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    beta: float = field(default=0.1, metadata={"help": "DPO temperature (strength of the reference anchor)."})
    loss_type: str = field(default="sigmoid", metadata={"help": "'sigmoid' (DPO), 'ipo' or 'hinge'."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Conservative DPO label noise (sigmoid only)."})

    RULES = {"beta": between(1e-4, 100), "loss_type": one_of(*DPO_LOSS_TYPES), "label_smoothing": between(0, 0.5)}

    def check(self) -> None:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise UsageError(f"--label_smoothing applies to --loss_type sigmoid only, not {self.loss_type}")


def sequence_logprobs(model, batch: dict[str, torch.Tensor], adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected): the summed log-probs of each pair's completion tokens under `adapter`, from one row
    per pair (SharedPromptPairCollator: the prompt once) or from chosen rows over rejected rows (PairCollator)."""
    if "segments" in batch:
        return model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="pair_logprobs",
                     labels=batch["labels"], segments=batch["segments"])
    logp = model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="logprobs",
                 labels=batch["labels"])
    return logp.sum(dim=1).chunk(2)


def dpo_terms(model, batch: dict[str, torch.Tensor], args: DPOArguments):
    """Per-pair DPO losses and implicit rewards from one policy and one reference pass."""
    policy_c, policy_r = sequence_logprobs(model, batch, POLICY)
    with torch.no_grad():
        ref_c, ref_r = sequence_logprobs(model, batch, REFERENCE)
    losses, reward_c, reward_r = dpo_loss(policy_c, policy_r, ref_c, ref_r, args.beta, args.loss_type,
                                          args.label_smoothing)
    return losses, reward_c, reward_r, policy_c.detach(), policy_r.detach()


@torch.no_grad()
def implicit_reward_accuracy(model, examples: Sequence[PairExample], collate: PairCollator, args: DPOArguments,
                             batch_size: int, accelerator, max_batches: int = 0,
                             progress: bool = True) -> dict[str, float]:
    """Held-out accuracy of DPO's implicit reward beta * (log pi - log pi_ref) on chosen vs rejected."""
    chosen, rejected = [], []
    for batch, real in eval_batches(examples, collate, batch_size, accelerator, max_batches, "accuracy", progress):
        _, rc, rr, _, _ = dpo_terms(model, batch, args)
        if real:
            chosen += rc.float().tolist()
            rejected += rr.float().tolist()
    rc, rr = torch.tensor(gather_object(chosen)), torch.tensor(gather_object(rejected))
    return {"rewards/accuracies": (rc > rr).float().mean().item(), "rewards/margins": (rc - rr).mean().item(),
            "rewards/chosen": rc.mean().item(), "rewards/rejected": rr.mean().item(), "pairs": float(rc.numel())}


ARGUMENTS = DPOArguments  # the `stage:` section of this stage's config


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(DPOArguments, argv, stage="dpo")
    tok, data_args, targs, args = ctx.tokenizer, ctx.data_args, ctx.train_args, ctx.stage_args
    # DPO learns from preference pairs: the reward model's subset (no reward model is trained).
    train, _ = tokenize_pairs(ctx.splits.reward, tok, data_args)
    held_out, _ = tokenize_pairs(ctx.splits.eval, tok, data_args)
    ctx.require_batch(train, "DPO training pairs")
    specs = stage_specs("dpo", {POLICY: args.sft_adapter, REFERENCE: args.sft_adapter})
    model = ctx.build_model(specs)
    collate = pair_collator(tok.pad_token_id, targs.share_pair_prompts, model)

    def compute_loss(batch: dict[str, torch.Tensor], normaliser: float) -> StepOutput:
        losses, rc, rr, pc, pr = dpo_terms(harness.engine.model, batch, args)
        loss = step_mean_share(losses, normaliser)
        metrics = {"rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
                   "rewards/accuracies": (rc > rr).float().mean(), "rewards/margins": (rc - rr).mean(),
                   "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}
        return StepOutput(loss, metrics, tokens=int(batch["attention_mask"].sum()))

    def evaluate(engine) -> dict[str, float]:
        return implicit_reward_accuracy(engine.model, held_out, collate, args, targs.eval_batch_size,
                                        ctx.accelerator, targs.eval_batches, targs.progress_bar)

    harness = Harness(ctx, model, "dpo", [POLICY], train, collate, evaluate,
                      by_length=True,
                      log_keys=["train/loss", "train/rewards/accuracies", "train/lr", "train/grad_norm",
                                "perf/tokens_per_s", "perf/peak_gb"])
    harness.train(supervised_step(harness.engine, compute_loss, targs.gradient_accumulation_steps, pairs_in))
    return finish_stage(ctx, "dpo", model, POLICY, train_pairs=len(train), eval_pairs=len(held_out))


if __name__ == "__main__":
    run(main)
