"""Evaluate a saved adapter on any hh-rlhf-format file and print one JSON line.

    python -m trainer.evaluate sft    --adapter runs/sft/adapter    --data PATH   # perplexity
    python -m trainer.evaluate reward --adapter runs/reward/adapter --data PATH   # pairwise accuracy
    python -m trainer.evaluate dpo    --adapter runs/dpo/adapter    --split eval  # implicit-reward accuracy

PATH is a .jsonl / .jsonl.gz / .parquet file or folder, or a hub id. Every row is used, unless
`--split eval|sft|reward|ppo` picks that subset of the stage run the adapter came from (the split
settings, and the data when --data is not given, are read from the run's config.json beside the
adapter folder). DPO scores the policy adapter against its frozen reference: the run's SFT adapter
unless `--reference` names another (the base model when the run had none).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from trainer.collators import PairCollator, SFTCollator
from trainer.config import DataArguments
from trainer.data import load_pairs, load_splits
from trainer.dpo import DPOArguments, implicit_reward_accuracy
from trainer.models import load_tokenizer
from trainer.reward import reward_accuracy
from trainer.run import base_model_args
from trainer.run_report import wilson_interval
from trainer.sft import completion_perplexity
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import tokenize_pairs, tokenize_sft

TASKS = ("sft", "reward", "dpo")
SPLITS = ("all", "eval", "sft", "reward", "ppo")
RUN_CONFIG = "config.json"


@dataclass
class EvalArguments:
    adapter: str = field(metadata={"help": "Adapter folder saved by a stage (PEFT format, + head for reward)."})
    data: Optional[str] = field(default=None, metadata={
        "help": "hh-rlhf-format file or folder (.jsonl, .jsonl.gz, .parquet) or hub id; default: the run's dataset."})
    split: str = field(default="all", metadata={
        "help": "'all' rows of --data, or one subset of the adapter's run: eval, sft, reward or ppo."})
    reference: Optional[str] = field(default=None, metadata={
        "help": "dpo: the frozen reference adapter (default: the run's sft_adapter; none there: the base model)."})
    beta: Optional[float] = field(default=None, metadata={"help": "dpo: beta of the implicit reward (default: the run's)."})
    max_length: Optional[int] = field(default=None, metadata={
        "help": "Token limit per row, prompts left-truncated (default: the run's with --split, else 512)."})
    batch_size: int = field(default=8, metadata={"help": "Rows (sft) or pairs (reward) per forward pass."})
    limit: int = field(default=0, metadata={"help": "Use only the first N rows (0: all)."})
    on_bad_row: str = field(default="skip", metadata={"help": "'skip' or 'error' for malformed rows."})
    output_file: Optional[str] = field(default=None, metadata={
        "help": "Also write the result, with provenance (device, date, command, git revision), to this JSON file."})
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Override the adapter's base model."})
    quantization: Optional[str] = field(default=None, metadata={"help": "Override the base quantization."})


def run_config(adapter: str) -> dict:
    """The config.json of the stage run that saved `adapter` ({} when the folder is not in a run)."""
    path = Path(adapter).resolve().parent / RUN_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def data_arguments(args: EvalArguments, run: dict) -> DataArguments:
    """All rows of --data, or the run's split settings (and dataset, unless --data overrides it)."""
    if args.split not in SPLITS:
        raise SystemExit(f"unknown split '{args.split}': use one of {', '.join(SPLITS)}")
    if args.split == "all":
        if args.data is None:
            raise SystemExit("--data is needed with --split all (or pick a split of the adapter's run)")
        return DataArguments(dataset=args.data, on_bad_row=args.on_bad_row, max_length=args.max_length or 512)
    if "data" not in run:
        raise SystemExit(f"--split {args.split} reads the split settings from the run's {RUN_CONFIG}, and "
                         f"{Path(args.adapter).resolve().parent / RUN_CONFIG} does not exist: use --split all --data PATH")
    values = {**run["data"], "on_bad_row": args.on_bad_row}
    if args.max_length is not None:
        values["max_length"] = args.max_length
    if args.data is not None:
        values["dataset"] = args.data
    return DataArguments(**values)


def adapter_specs(task: str, args: EvalArguments, run: dict) -> list[AdapterSpec]:
    if task == "sft":
        return [AdapterSpec("policy", init_from=args.adapter)]
    if task == "reward":
        return [AdapterSpec("reward", init_from=args.adapter, head=True)]
    reference = args.reference or run.get("stage", {}).get("sft_adapter")
    if reference is not None and not (Path(reference) / "adapter_config.json").is_file():
        raise SystemExit(f"dpo reference adapter {reference} is not a PEFT adapter folder: pass --reference DIR")
    return [AdapterSpec("policy", init_from=args.adapter), AdapterSpec("reference", init_from=reference)]


def evaluate(task: str, args: EvalArguments) -> dict:
    from accelerate import Accelerator

    if task not in TASKS:
        raise SystemExit(f"unknown task '{task}': use one of {', '.join(TASKS)}")
    run = run_config(args.adapter)
    data_args = data_arguments(args, run)
    specs = adapter_specs(task, args, run)
    model_args = base_model_args(args.adapter, model_name_or_path=args.model_name_or_path,
                                 quantization=args.quantization, gradient_checkpointing=False)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                                   model_args.tokenizer_name_or_path)
    if args.split == "all":
        pairs, report = load_pairs(data_args)
    else:
        splits, report = load_splits(data_args)
        pairs = getattr(splits, args.split)
    if args.limit:
        pairs = pairs[: args.limit]
    model = build_shared_model(model_args, specs, vocab_size=len(tokenizer), device=accelerator.device).eval()
    with torch.no_grad(), accelerator.autocast():
        if task == "sft":
            examples, tok_report = tokenize_sft(pairs, tokenizer, data_args)
            result = completion_perplexity(model, examples, SFTCollator(tokenizer.pad_token_id), args.batch_size,
                                           accelerator, adapter="policy")
            result["rows"] = len(examples)
        elif task == "reward":
            examples, tok_report = tokenize_pairs(pairs, tokenizer, data_args)
            result = reward_accuracy(model, examples, PairCollator(tokenizer.pad_token_id), args.batch_size,
                                     accelerator, adapter="reward")
            result["pairs"] = len(examples)
        else:
            examples, tok_report = tokenize_pairs(pairs, tokenizer, data_args)
            beta = args.beta if args.beta is not None else run.get("stage", {}).get("beta", 0.1)
            dpo_args = DPOArguments(beta=beta, eval_batch_size=args.batch_size)
            result = implicit_reward_accuracy(model, examples, PairCollator(tokenizer.pad_token_id), dpo_args,
                                              accelerator)
            result["reference"] = specs[1].init_from
    if "accuracy" in result or "rewards/accuracies" in result:
        n = int(result["pairs"])
        result["accuracy_ci95"] = list(wilson_interval(result.get("accuracy", result.get("rewards/accuracies")), n))
    return {"task": task, "adapter": args.adapter, "data": data_args.dataset, "split": args.split, **result,
            "skipped_rows": sum(report.skipped.values()) + tok_report.too_long, "truncated_rows": tok_report.truncated}


def main(argv: Optional[list[str]] = None) -> dict:
    import logging

    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"usage: python -m trainer.evaluate {{{','.join(TASKS)}}} --adapter DIR "
                         f"[--data PATH] [--split {'|'.join(SPLITS)}]")
    task = argv.pop(0)
    (args,) = HfArgumentParser(EvalArguments).parse_args_into_dataclasses(args=argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    result = evaluate(task, args)
    print(json.dumps(result), flush=True)
    if args.output_file:
        from profiling.provenance import provenance
        from profiling.report import write_atomic

        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        write_atomic(out, json.dumps({**result, "provenance": provenance(device)}, indent=2))
    return result


if __name__ == "__main__":
    main()
