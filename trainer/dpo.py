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

from trainer.collators import PairCollator
from trainer.losses import dpo_loss
from trainer.loop import StepOutput, run_training
from trainer.run import finish_stage, start_run
from trainer.sft import rank_shard
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import PairExample, tokenize_pairs


@dataclass
class DPOArguments:
    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    beta: float = field(default=0.1, metadata={"help": "DPO temperature (strength of the reference anchor)."})
    loss_type: str = field(default="sigmoid", metadata={"help": "'sigmoid' (DPO), 'ipo' or 'hinge'."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Conservative DPO label noise (sigmoid only)."})
    eval_batch_size: int = field(default=8, metadata={"help": "Pairs per evaluation forward pass."})


def sequence_logprobs(model, batch: dict[str, torch.Tensor], adapter: str) -> torch.Tensor:
    """(2B,) summed log-probs of each row's completion tokens under `adapter`."""
    logp = model(batch["input_ids"], batch["attention_mask"], adapter=adapter, output="logprobs",
                 labels=batch["labels"])
    return logp.sum(dim=1)


def dpo_terms(model, batch: dict[str, torch.Tensor], args: DPOArguments):
    """Per-pair DPO losses and implicit rewards from one policy and one reference pass."""
    policy_c, policy_r = sequence_logprobs(model, batch, "policy").chunk(2)
    with torch.no_grad():
        ref_c, ref_r = sequence_logprobs(model, batch, "reference").chunk(2)
    losses, reward_c, reward_r = dpo_loss(policy_c, policy_r, ref_c, ref_r, args.beta, args.loss_type,
                                          args.label_smoothing)
    return losses, reward_c, reward_r, policy_c.detach(), policy_r.detach()


@torch.no_grad()
def implicit_reward_accuracy(model, examples: Sequence[PairExample], collate: PairCollator, args: DPOArguments,
                             accelerator, max_batches: int = 0) -> dict[str, float]:
    """Held-out accuracy of DPO's implicit reward beta * (log pi - log pi_ref) on chosen vs rejected."""
    mine = rank_shard(examples, accelerator)
    chosen, rejected = [], []
    for i, start in enumerate(range(0, len(mine), args.eval_batch_size)):
        if max_batches and i >= max_batches:
            break
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start : start + args.eval_batch_size]).items()}
        _, rc, rr, _, _ = dpo_terms(model, batch, args)
        chosen += rc.float().tolist()
        rejected += rr.float().tolist()
    rc, rr = torch.tensor(gather_object(chosen)), torch.tensor(gather_object(rejected))
    return {"rewards/accuracies": (rc > rr).float().mean().item(), "rewards/margins": (rc - rr).mean().item(),
            "rewards/chosen": rc.mean().item(), "rewards/rejected": rr.mean().item(), "pairs": float(rc.numel())}


class DPOStage:
    name = "dpo"
    trainable_adapters = ["policy"]

    def __init__(self, args: DPOArguments, eval_examples: Sequence[PairExample], collate: PairCollator,
                 eval_batches: int):
        self.args, self.eval_examples, self.collate, self.eval_batches = args, eval_examples, collate, eval_batches

    def compute_loss(self, model, batch: dict[str, torch.Tensor]) -> StepOutput:
        losses, rc, rr, pc, pr = dpo_terms(model, batch, self.args)
        loss = losses.mean()
        metrics = {"loss": loss.detach(), "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
                   "rewards/accuracies": (rc > rr).float().mean(), "rewards/margins": (rc - rr).mean(),
                   "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}
        return StepOutput(loss, metrics, tokens=int(batch["attention_mask"].sum()))

    def evaluate(self, model, accelerator) -> dict[str, float]:
        return implicit_reward_accuracy(model, self.eval_examples, self.collate, self.args, accelerator,
                                        self.eval_batches)


def main(argv: Optional[list[str]] = None) -> dict:
    ctx = start_run(DPOArguments, argv, stage="dpo")
    tok, data_args, args = ctx.tokenizer, ctx.data_args, ctx.stage_args
    if args.loss_type not in ("sigmoid", "ipo", "hinge"):
        raise SystemExit(f"unknown loss_type '{args.loss_type}': use sigmoid, ipo or hinge")
    # DPO learns from preference pairs: the reward model's subset (no reward model is trained).
    train, _ = tokenize_pairs(ctx.splits.reward, tok, data_args)
    held_out, _ = tokenize_pairs(ctx.splits.eval, tok, data_args)
    specs = [AdapterSpec("policy", trainable=True, init_from=args.sft_adapter),
             AdapterSpec("reference", trainable=False, init_from=args.sft_adapter)]
    model = build_shared_model(ctx.model_args, specs, vocab_size=len(tok), device=ctx.accelerator.device)
    collate = PairCollator(tok.pad_token_id)
    stage = DPOStage(args, held_out, collate, ctx.train_args.eval_batches)
    run_training(stage, model, train, collate, ctx.train_args, ctx.accelerator, config=ctx.config(),
                 resume_from=ctx.resume_from)
    return finish_stage(ctx, "dpo", model, "policy", train_pairs=len(train), eval_pairs=len(held_out))


if __name__ == "__main__":
    main()
