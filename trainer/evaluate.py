"""Evaluate a saved adapter on any hh-rlhf-format file and print one JSON line.

    python -m trainer.evaluate sft    --adapter runs/sft/adapter    --data PATH   # perplexity
    python -m trainer.evaluate dpo    --adapter runs/dpo/adapter    --split eval  # implicit-reward accuracy
    python -m trainer.evaluate exact_match --adapter runs/grpo/adapter --data heldout.jsonl \
        --reward_fn benchmarks/arithmetic/rewards.py:correct,benchmarks/arithmetic/rewards.py:formatted

PATH is a file, folder or hub id; `--split eval|sft|reward|ppo` picks that subset of the adapter's own run
(read from its config.json). `reward` gives pairwise accuracy; DPO scores against the run's SFT adapter
unless `--reference` names another. `exact_match` answers each prompt of a prompt-only file greedily (the
adapter, or `--adapter none`: the base model) and reports each `--reward_fn` check's mean with a 95% interval
(Wilson for 0/1 scores) and the mean response length; `--output_file` writes a Markdown table beside the JSON.
The figures come from the functions the stages evaluate with.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from foundation.cli import Checked, InputError, UsageError, above, at_least, one_of, run
from foundation.files import write_atomic
from foundation.reward_specs import split_specs
from foundation.settings import BAD_ROW_POLICIES, DataArguments, ModelArguments
from foundation.stages import POLICY, REFERENCE, REWARD
from trainer.data.collators import SFTCollator, pair_collator
from trainer.data.formats import parser_for
from trainer.data.hh_rlhf import load_pairs, load_splits
from trainer.data.tokenization import tokenize_pairs, tokenize_prompts, tokenize_sft
from trainer.dpo import DPOArguments, implicit_reward_accuracy
from trainer.engine.setup import base_model_args
from trainer.model.decode import Generator
from trainer.model.loading import load_tokenizer
from trainer.model.shared_base import AdapterSpec, build_shared_model, check_adapter_folder
from trainer.reward import reward_accuracy
from trainer.rl.policy_eval import check_answers
from trainer.rl.rewards import Scorer, close_workers, describe, load_reward_functions
from trainer.run_report import wilson_interval
from trainer.sft import completion_perplexity

TASKS = ("sft", "reward", "dpo", "exact_match")
BASE = "none"  # --adapter none: the base model without an adapter
SPLITS = ("all", "eval", "sft", "reward", "ppo")
RUN_CONFIG = "config.json"


@dataclass
class EvalArguments(Checked):
    adapter: str = field(metadata={
        "help": "Adapter folder saved by a stage (PEFT format, + head for reward); exact_match: 'none' is the base."})
    data: Optional[str] = field(default=None, metadata={
        "help": "hh-rlhf-format file or folder (.jsonl, .jsonl.gz, .parquet) or hub id; default: the run's dataset."})
    split: str = field(default="all", metadata={
        "help": "'all' rows of --data, or one subset of the adapter's run: eval, sft, reward or ppo."})
    reference: Optional[str] = field(default=None, metadata={
        "help": "dpo: the frozen reference adapter (default: the run's sft_adapter; none there: the base model)."})
    beta: Optional[float] = field(default=None, metadata={"help": "dpo: beta of the implicit reward (default: the run's)."})
    max_length: Optional[int] = field(default=None, metadata={
        "help": "Token limit per row, prompts left-truncated (default: the run's with --split, else 512)."})
    batch_size: int = field(default=8, metadata={"help": "Rows (sft) or pairs (reward, dpo) per forward pass."})
    limit: int = field(default=0, metadata={"help": "Use only the first N usable rows (0: all)."})
    on_bad_row: str = field(default="skip", metadata={"help": "'skip' or 'error' for malformed rows."})
    output_file: Optional[str] = field(default=None, metadata={
        "help": "Also write the result, with provenance (device, date, command, git revision), to this JSON file."})
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Override the adapter's base model."})
    quantization: Optional[str] = field(default=None, metadata={"help": "Override the base quantization."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Allow the base model's own code from the hub (never taken from the adapter's files)."})
    progress_bar: bool = field(default=True, metadata={"help": "Show a progress bar over the batches (stderr)."})
    reward_fn: Optional[str] = field(default=None, metadata={
        "help": "exact_match: the check functions, PATH.py:NAME or module:NAME, comma-separated (as PPO's / GRPO's)."})
    max_new_tokens: int = field(default=64, metadata={"help": "exact_match: response length limit (greedy)."})
    samples: int = field(default=5, metadata={"help": "exact_match: responses shown in the result."})

    RULES = {"split": one_of(*SPLITS), "beta": above(0), "max_length": at_least(2), "batch_size": at_least(1),
             "limit": at_least(0), "on_bad_row": one_of(*BAD_ROW_POLICIES), "max_new_tokens": at_least(1),
             "samples": at_least(0),
             "output_file": lambda name, value: _output_file_rule(value)}


def _output_file_rule(value: str) -> Optional[str]:
    """Checked before the evaluation runs, so its result is not lost to a path that cannot be written."""
    path = Path(value).expanduser()
    if path.is_dir():
        return f"is a folder; name a JSON file (e.g. {path / 'evaluation.json'})"
    blocker = next((p for p in path.parents if p.is_file()), None)
    return f"lies under {blocker}, which is a file" if blocker else None


def run_config(adapter: str) -> dict:
    """The config.json of the stage run that saved `adapter` ({} when the folder is not in a run)."""
    path = Path(adapter).resolve().parent / RUN_CONFIG
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None


def data_arguments(args: EvalArguments, run: dict) -> DataArguments:
    """All rows of --data, or the run's split settings (and dataset, unless --data overrides it)."""
    if args.split == "all":
        if args.data is None:
            raise UsageError("--data is needed with --split all (or pick a split of the adapter's run)")
        return DataArguments(dataset=args.data, on_bad_row=args.on_bad_row, max_length=args.max_length or 512)
    if "data" not in run:
        raise UsageError(f"--split {args.split} reads the split settings from the run's {RUN_CONFIG}, and "
                         f"{Path(args.adapter).resolve().parent / RUN_CONFIG} does not exist: use --split all --data PATH")
    values = {**run["data"], "on_bad_row": args.on_bad_row}
    if args.max_length is not None:
        values["max_length"] = args.max_length
    if args.data is not None:
        values["dataset"] = args.data
    return DataArguments(**values)


def adapter_specs(task: str, args: EvalArguments, run: dict) -> list[AdapterSpec]:
    """Frozen adapters to score with: the policy (sft, dpo, with dpo's reference) or the reward model + head."""
    check_adapter_folder(args.adapter, "--adapter")
    if task == "sft":
        return [AdapterSpec(POLICY, init_from=args.adapter)]
    if task == "reward":
        return [AdapterSpec(REWARD, init_from=args.adapter, head=True)]
    reference = args.reference or run.get("stage", {}).get("sft_adapter")
    if reference is not None:
        check_adapter_folder(reference, "--reference")
    return [AdapterSpec(POLICY, init_from=args.adapter), AdapterSpec(REFERENCE, init_from=reference)]


def evaluate(task: str, args: EvalArguments) -> dict:
    from accelerate import Accelerator

    if task == "exact_match":
        return evaluate_answers(args)
    run = run_config(args.adapter)
    data_args = data_arguments(args, run)
    specs = adapter_specs(task, args, run)
    model_args = base_model_args(args.adapter, trust_remote_code=args.trust_remote_code,
                                 model_name_or_path=args.model_name_or_path,
                                 quantization=args.quantization, gradient_checkpointing=False)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                               model_args.tokenizer_name_or_path, model_args.trust_remote_code)
    parse = parser_for(data_args, tokenizer)
    if args.split == "all":
        pairs, report = load_pairs(data_args, limit=args.limit, parse=parse)  # skips counted among the rows read only
    else:
        splits, report = load_splits(data_args, parse)
        pairs = getattr(splits, args.split)[: args.limit or None]
    tokenize = tokenize_sft if task == "sft" else tokenize_pairs
    examples, tok_report = tokenize(pairs, tokenizer, data_args)
    if not examples:
        raise InputError(f"no usable rows in {data_args.dataset} ({report.summary()}; {tok_report.summary()})")
    model = build_shared_model(model_args, specs, vocab_size=len(tokenizer), device=accelerator.device).eval()
    with torch.no_grad(), accelerator.autocast():
        if task == "sft":
            result = completion_perplexity(model, examples, SFTCollator(tokenizer.pad_token_id), args.batch_size,
                                           accelerator, progress=args.progress_bar, interval=True)
            result["rows"] = len(examples)
        elif task == "reward":
            result = reward_accuracy(model, examples, pair_collator(tokenizer.pad_token_id, True, model),
                                     args.batch_size, accelerator, progress=args.progress_bar)
        else:  # pairs in the stages' layout (one row per pair where the attention takes the pair mask)
            beta = args.beta if args.beta is not None else run.get("stage", {}).get("beta", 0.1)
            result = implicit_reward_accuracy(model, examples, pair_collator(tokenizer.pad_token_id, True, model),
                                              DPOArguments(beta=beta), args.batch_size, accelerator,
                                              progress=args.progress_bar)
            result["reference"] = specs[1].init_from
    accuracy = result.get("accuracy", result.get("rewards/accuracies"))
    if accuracy is not None:
        result["accuracy_ci95"] = list(wilson_interval(accuracy, int(result["pairs"])))
    skipped = tok_report.too_long + (sum(report.skipped.values()) if args.split == "all" else 0)
    out = {"task": task, "adapter": args.adapter, "data": data_args.dataset, "split": args.split, **result,
           "skipped_rows": skipped, "truncated_rows": tok_report.truncated}
    if args.split != "all":  # the split needs the whole source read; what it dropped is said apart
        out["source_skipped_rows"] = sum(report.skipped.values())
    return out


def check_summary(values: list[Optional[float]]) -> dict:
    """A check function's mean over the rows it applies to, with a 95% interval: Wilson's for 0/1 values,
    else mean +- 1.96 standard errors."""
    counted = [v for v in values if v is not None]
    if not counted:
        return {"mean": None, "ci95": None, "interval": None, "rows": 0}
    n, mean = len(counted), sum(counted) / len(counted)
    if set(counted) <= {0.0, 1.0}:
        return {"mean": mean, "ci95": list(wilson_interval(mean, n)), "interval": "wilson", "rows": n}
    half = 1.96 * statistics.stdev(counted) / math.sqrt(n) if n > 1 else 0.0
    return {"mean": mean, "ci95": [mean - half, mean + half], "interval": "normal", "rows": n}


def answer_model_args(args: EvalArguments) -> ModelArguments:
    """The adapter's base model (overrides applied), or with `--adapter none` the named / default base."""
    overrides = dict(model_name_or_path=args.model_name_or_path, quantization=args.quantization,
                     gradient_checkpointing=False)
    if args.adapter != BASE:
        check_adapter_folder(args.adapter, "--adapter")
        return base_model_args(args.adapter, trust_remote_code=args.trust_remote_code, **overrides)
    return ModelArguments(**{k: v for k, v in overrides.items() if v is not None},
                          trust_remote_code=args.trust_remote_code)


def check_answer_positions(model_args, prompts, max_new_tokens: int, vocab_size: int) -> None:
    """The longest prompt and its answer must fit the base model's positions, as training requires."""
    from trainer.model.loading import max_positions

    positions = max_positions(model_args, vocab_size)
    longest = max(len(p.prompt_ids) for p in prompts)
    if positions is not None and longest + max_new_tokens > positions:
        raise UsageError(f"--max_new_tokens {max_new_tokens}: the longest prompt ({longest} tokens) and its answer "
                         f"exceed the {positions} positions of {model_args.model_name_or_path}: use at most "
                         f"{max(positions - longest, 0)}")


def evaluate_answers(args: EvalArguments) -> dict:
    """exact_match: greedy answers to every prompt of --data, each check function's mean and interval."""
    from accelerate import Accelerator

    if not args.reward_fn:
        raise UsageError("exact_match needs --reward_fn: the functions that check an answer (PATH.py:NAME, ...)")
    if args.data is None:
        raise UsageError("exact_match needs --data: a prompt-only file of held-out problems")
    specs = split_specs(args.reward_fn)
    functions = load_reward_functions(specs, [1.0] * len(specs))  # imported before the model: a bad one fails fast
    logging.getLogger(__name__).info("%s", describe(functions).replace("reward functions", "checks", 1))
    model_args = answer_model_args(args)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                               model_args.tokenizer_name_or_path, model_args.trust_remote_code)
    data_args = DataArguments(dataset=args.data, on_bad_row=args.on_bad_row, data_format="prompt_only")
    pairs, report = load_pairs(data_args, limit=args.limit, parse=parser_for(data_args, tokenizer))
    prompts, tok_report = tokenize_prompts(pairs, tokenizer, data_args)
    if not prompts:
        raise InputError(f"no usable prompts in {args.data} ({report.summary()}; {tok_report.summary()})")
    check_answer_positions(model_args, prompts, args.max_new_tokens, len(tokenizer))
    spec = AdapterSpec(POLICY, init_from=None if args.adapter == BASE else args.adapter)
    model = build_shared_model(model_args, [spec], vocab_size=len(tokenizer), device=accelerator.device)
    with accelerator.autocast():
        checks = check_answers(Generator(model), prompts, Scorer(functions, tokenizer, adapter=None), tokenizer,
                               args.max_new_tokens, args.batch_size, progress=args.progress_bar)
    close_workers(functions)
    lengths = [float(n) for n in checks.lengths]
    samples = [{"source": e.source, **{k: v for k, v in e.columns.items() if k != "prompt"}, "response": r}
               for e, r in zip(prompts[: args.samples], checks.responses)]
    return {"task": "exact_match", "adapter": args.adapter, "base_model": model_args.model_name_or_path,
            "data": args.data, "rows": len(prompts), "decoding": "greedy", "max_new_tokens": args.max_new_tokens,
            "checks": {name: check_summary(values) for name, values in checks.values.items()},
            "mean_length": check_summary(lengths), "samples": samples,
            "skipped_rows": sum(report.skipped.values()) + tok_report.too_long}


def answers_markdown(result: dict) -> str:
    """exact_match's result as a Markdown table, with where it came from."""
    prov = result.get("provenance", {})
    lines = [f"# exact_match: {result['adapter']} on {result['data']}", "",
             f"{result['rows']} prompts, greedy, at most {result['max_new_tokens']} new tokens; base "
             f"{result['base_model']}.", "", "| check | mean | 95% interval | rows |", "|---|---|---|---|"]
    for name, c in {**result["checks"], "response length (tokens)": result["mean_length"]}.items():
        shown = "n/a" if c["mean"] is None else f"{c['mean']:.3f}"
        interval = "n/a" if c["ci95"] is None else f"{c['ci95'][0]:.3f} - {c['ci95'][1]:.3f} ({c['interval']})"
        lines.append(f"| {name} | {shown} | {interval} | {c['rows']} |")
    if prov:
        from foundation.provenance import shown_command

        lines += ["", f"Command: `{shown_command(prov)}`", "",
                  f"Date {prov['date']}, git revision {prov['git_revision']}, device {prov['device_name']}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    from foundation.cli import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in TASKS:
        raise UsageError(f"usage: python -m trainer.evaluate {{{','.join(TASKS)}}} --adapter DIR "
                         f"[--data PATH] [--split {'|'.join(SPLITS)}]" + (f" (not '{argv[0]}')" if argv else ""))
    task = argv.pop(0)
    command = ["python", "-m", "trainer.evaluate", task, *argv]  # what the provenance names, however it was called
    (args,) = parse([EvalArguments], argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s",
                        force=True)
    if args.output_file:  # a read-only or full target is found before the evaluation, not after it
        from foundation.files import check_writable

        check_writable(args.output_file, "--output_file")
    result = evaluate(task, args)
    print(json.dumps(result), flush=True)
    if args.output_file:
        from foundation.provenance import provenance, relative_command

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        result = {**result, "provenance": provenance(device, relative_command(command))}
        write_atomic(args.output_file, json.dumps(result, indent=2))
        if task == "exact_match":
            write_atomic(Path(args.output_file).with_suffix(".md"), answers_markdown(result))
    return result


if __name__ == "__main__":
    run(main)
