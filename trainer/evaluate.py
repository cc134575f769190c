"""Evaluate a saved adapter on any hh-rlhf-format file and print one JSON line.

    python -m trainer.evaluate sft    --adapter runs/sft/adapter    --data PATH   # perplexity
    python -m trainer.evaluate reward --adapter runs/reward/adapter --data PATH   # pairwise accuracy

PATH is a .jsonl / .jsonl.gz / .parquet file or folder (every row is used, no split), or a hub id.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainer.collators import PairCollator, SFTCollator
from trainer.config import DataArguments
from trainer.data import load_pairs
from trainer.models import load_tokenizer
from trainer.reward import reward_accuracy
from trainer.run import base_model_args
from trainer.sft import completion_perplexity
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import tokenize_pairs, tokenize_sft

TASKS = ("sft", "reward")


@dataclass
class EvalArguments:
    adapter: str = field(metadata={"help": "Adapter folder saved by a stage (PEFT format, + head for reward)."})
    data: str = field(metadata={"help": "hh-rlhf-format file or folder (.jsonl, .jsonl.gz, .parquet) or hub id."})
    max_length: int = field(default=512, metadata={"help": "Token limit per row (prompts left-truncated)."})
    batch_size: int = field(default=8, metadata={"help": "Rows (sft) or pairs (reward) per forward pass."})
    limit: int = field(default=0, metadata={"help": "Use only the first N rows (0: all)."})
    on_bad_row: str = field(default="skip", metadata={"help": "'skip' or 'error' for malformed rows."})
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Override the adapter's base model."})
    quantization: Optional[str] = field(default=None, metadata={"help": "Override the base quantization."})


def evaluate(task: str, args: EvalArguments) -> dict:
    from accelerate import Accelerator

    if task not in TASKS:
        raise SystemExit(f"unknown task '{task}': use one of {', '.join(TASKS)}")
    model_args = base_model_args(args.adapter, model_name_or_path=args.model_name_or_path,
                                 quantization=args.quantization, gradient_checkpointing=False)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                                   model_args.tokenizer_name_or_path)
    data_args = DataArguments(dataset=args.data, on_bad_row=args.on_bad_row, max_length=args.max_length)
    pairs, report = load_pairs(data_args)
    if args.limit:
        pairs = pairs[: args.limit]
    role = "policy" if task == "sft" else "reward"
    model = build_shared_model(model_args, [AdapterSpec(role, init_from=args.adapter, head=task == "reward")],
                               vocab_size=len(tokenizer), device=accelerator.device).eval()
    with torch.no_grad(), accelerator.autocast():
        if task == "sft":
            examples, tok_report = tokenize_sft(pairs, tokenizer, data_args)
            result = completion_perplexity(model, examples, SFTCollator(tokenizer.pad_token_id), args.batch_size,
                                           accelerator, adapter=role)
            result["rows"] = len(examples)
        else:
            examples, tok_report = tokenize_pairs(pairs, tokenizer, data_args)
            result = reward_accuracy(model, examples, PairCollator(tokenizer.pad_token_id), args.batch_size,
                                     accelerator, adapter=role)
            result["pairs"] = len(examples)
    return {"task": task, "adapter": args.adapter, "data": args.data, **result,
            "skipped_rows": sum(report.skipped.values()) + tok_report.too_long, "truncated_rows": tok_report.truncated}


def main(argv: Optional[list[str]] = None) -> dict:
    import logging

    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"usage: python -m trainer.evaluate {{{','.join(TASKS)}}} --adapter DIR --data PATH")
    task = argv.pop(0)
    (args,) = HfArgumentParser(EvalArguments).parse_args_into_dataclasses(args=argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    result = evaluate(task, args)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
