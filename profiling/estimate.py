"""Predict device memory per component and phase for a stage, before running it (the command line).

    python -m profiling.estimate --model llama-2-7b --stage ppo [--micro_batch_size 4 ...]
    python -m profiling.estimate --config trainer/configs/llama2_7b/ppo.yaml --stage ppo

Prints the table (components down, phases across), the peak against the budget, what to change when it
does not fit (`python -m benchmarks.seed` sets seed 000's breakdown beside ours). The settings are the stage
scripts' own, with their defaults, as flags or a stage's config file. `profiling.predict` holds the estimator.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from foundation.cli import auto_fields, flag_given, parse, run, unplanned
from foundation.config_files import config_flag, load_yaml
from foundation.files import check_writable, reported_write_failure, staged_files, write_atomic
from foundation.provenance import provenance
from foundation.settings import ONLINE_RL_STAGES, DataArguments, ModelArguments, TrainArguments
from profiling import components as C
from profiling.advice import advice_lines
from profiling.plan import PLANNABLE, planned_settings, plans, rollout_rows
from profiling.predict import EstimateArguments, estimate, resolve_shape
from profiling.report import markdown_table, write_reports


def families_table(args: EstimateArguments) -> str:
    """One row per model of `args.models` at the same settings: what each model costs the card."""
    rows, phases = [], None
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        one = replace(args, model_name_or_path=name, models=None)
        shape = resolve_shape(one)
        est = estimate(shape, one)
        phases = phases or [p["phase"] for p in est["phases"]]
        base = est["phases"][0]["components"]
        weights = sum(base.get(k) or 0 for k in (C.BASE_WEIGHTS, C.BASE_QUANT_CONSTANTS, C.BASE_OTHER))
        cells = [f"{C.gib(p['total'])}" for p in est["phases"]]
        rows.append(f"| {name} | {shape.total_params() / 1e9:.2f}B | {shape.num_kv_heads}/{shape.num_heads} | "
                    f"{shape.vocab_size:,} | {C.gib(weights)} | " + " | ".join(cells) +
                    f" | {C.gib(est['peak_bytes'])} ({est['peak_phase']}) |")
    used = args.resolved()
    head = [f"stage {args.stage}, {used.quantization}, {used.dtype}, {used.optimizer}, LoRA r={args.lora_r} "
            f"{args.lora_target_modules}, checkpointing {'on' if args.gradient_checkpointing else 'off'}; GiB",
            "", "| model | parameters | KV heads / heads | vocabulary | base weights | " +
            " | ".join(phases or []) + " | peak |", "|---|---:|---:|---:|---:|" + "---:|" * (len(phases or []) + 1)]
    return "\n".join(head + rows)


def card_fits(shape, args: EstimateArguments, planned: set[str]) -> dict:
    """Which card sizes of `args.cards` hold the run, each as its memory_budget_gib with the plan a PPO / GRPO run
    with --auto_fit makes for it: {"rows": [{card_gib, fits, peak_bytes, peak_phase, plan (settings or None)}],
    "smallest_gib": the smallest that holds it, or None}."""
    planning = plans(args, planned)
    rows = []
    for gib in args.card_sizes():
        at, plan = replace(args, memory_budget_gib=gib), None
        if planning:
            at, plan = planned_settings(shape, at, planned)
        est = estimate(shape, at)
        rows.append({"card_gib": gib, "fits": bool(est["fits"] and (plan is not None or not planning)),
                     "peak_bytes": est["peak_bytes"], "peak_phase": est["peak_phase"], "planned": planning,
                     "plan": plan.settings() if plan is not None else None})
    return {"rows": rows, "smallest_gib": next((r["card_gib"] for r in rows if r["fits"]), None)}


def cards_markdown(shape, args: EstimateArguments, cards: dict) -> str:
    """`card_fits`' rows as a table, and the smallest card's line."""

    def how(row: dict) -> str:
        plan = row["plan"]
        if plan is None:
            return "nothing fits (the settings left auto estimated at their defaults)" if row["planned"] else \
                "the settings as given"
        offloads = [name for name in ("embeddings", "activations") if plan[f"offload_{name}"]]
        return (f"{plan['rollout_micro_batch_size']} rows a generate/score pass, micro-batch "
                f"{plan['micro_batch_size']}, checkpointing {'on' if plan['gradient_checkpointing'] else 'off'}, "
                f"offloaded: {', '.join(offloads) or 'nothing'}; decode {plan['decode']} from the "
                f"{plan['generation_weights']} weights")

    used = args.resolved()
    lines = [f"{shape.name}, stage {args.stage}, {used.quantization}, {used.optimizer}, LoRA r={args.lora_r}: each "
             "card as memory_budget_gib (GiB)", "", "| card GiB | fits | peak GiB (phase) | settings |",
             "|---:|---|---|---|"]
    lines += [f"| {r['card_gib']:g} | {'yes' if r['fits'] else '**no**'} | {C.gib(r['peak_bytes'])} "
              f"({r['peak_phase']}) | {how(r)} |" for r in cards["rows"]]
    smallest = cards["smallest_gib"]
    lines += ["", f"smallest card that holds it: {smallest:g} GiB" if smallest is not None else
              f"none of the cards holds it (largest {max(args.card_sizes()):g} GiB)"]
    return "\n".join(lines)


def _setting(args: EstimateArguments) -> str:
    """The settings a reader of the cards table needs: quantization, optimizer, LoRA rank, the work per step."""
    used = args.resolved()
    if args.stage in ONLINE_RL_STAGES:
        work = f"{rollout_rows(args)} rows x ({args.max_prompt_length} + {args.max_new_tokens}) tokens a step"
    else:
        work = f"{args.micro_batch_size} rows of {args.max_length} tokens a pass"
    return f"{used.quantization}, {used.optimizer}, LoRA r={args.lora_r}, {work}"


def _command(argv: list[str]) -> str:
    return "python -m profiling.estimate " + " ".join(shlex.quote(a) for a in argv)


def parse_estimate(argv: list[str]) -> EstimateArguments:
    """The flags, over a stage's config file (`--config`): its model, data and train sections whole, and of
    its stage section the settings a run's memory depends on (its method's own are left out). A reward
    adapter named (or `--reward_adapter null`) says whether a reward model is loaded, as in the run."""
    config_path, argv = config_flag(argv)
    sections = {"model": ModelArguments, "data": DataArguments, "train": TrainArguments, "stage": EstimateArguments}
    defaults = load_yaml(config_path, sections, beside=("stage",)) if config_path else {}
    (args,) = parse([EstimateArguments], argv, defaults, config_path)
    named = {name for name in ("reward_adapter", "reward_model") if name in defaults or flag_given(name, argv)}
    if "reward_adapter" in named and "reward_model" not in named:  # as a run reads it (`EstimateArguments.of_run`)
        (args,) = parse([EstimateArguments], argv, {**defaults, "reward_model": args.reward_adapter is not None},
                        config_path)
    return args


def check_outputs(args: EstimateArguments) -> None:
    """`--json` names a file and `--out_dir` a folder, each where this process can write: one line before the
    estimate, not a traceback after it."""
    if args.json:
        check_writable(args.json, "--json")
    if args.out_dir:
        check_writable(args.out_dir, "--out_dir", folder=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_estimate(argv)
    planned = set(PLANNABLE) & auto_fields(args)  # what a run plans; estimated at their unplanned values otherwise
    args = unplanned(args)
    check_outputs(args)
    if args.models:
        print(families_table(args))
        return 0
    shape = resolve_shape(args)
    if args.cards:
        cards = card_fits(shape, args, planned)
        table = cards_markdown(shape, args, cards)
        print(table)
        if args.out_dir:  # the estimator's answer to "which card?", with its provenance, for the results
            record = {**provenance(command=_command(argv)), "device": "estimate",
                      "device_name": f"estimate for {args.device}", "model": shape.name, "stage": args.stage,
                      "setting": _setting(args), **cards}
            out = Path(args.out_dir)
            with reported_write_failure(f"--out_dir {out}", out), staged_files(out) as tmp:
                write_atomic(tmp / "cards.json", json.dumps(record, indent=2) + "\n")
                write_atomic(tmp / "cards.md", f"# Which cards hold it: {shape.name} {args.stage} (an estimate)\n\n"
                             f"- date: {record['date']}\n- git revision: `{record['git_revision']}`\n"
                             f"- command: `{record['command']}`\n\n{table}\n")
            print(f"wrote {out / 'cards.json'} and cards.md")
        return 0
    if plans(args, planned):  # what the run plans at its start
        args, plan = planned_settings(shape, args, planned)
        print(plan.table() if plan else f"auto_fit: nothing fits memory_budget_gib={args.memory_budget_gib} with "
              "the settings given; the settings left auto are estimated at their defaults")
    est = estimate(shape, args)
    used = args.resolved()
    est.update({k: v for k, v in provenance(command=_command(argv)).items() if k not in est})
    est["device"], est["device_name"] = "estimate", f"estimate for {args.device}"
    print(f"{shape.name} ({shape.total_params() / 1e9:.2f}B parameters), stage {args.stage}, "
          f"{used.quantization}, {used.dtype}, {used.optimizer}, checkpointing "
          f"{'on' if args.gradient_checkpointing else 'off'}, {est['config']['trainable_parameters']:,} trainable "
          "parameters")
    print(markdown_table(est))
    print(f"peak: {C.gib(est['peak_bytes'])} GiB in phase '{est['peak_phase']}' against a budget of "
          f"{C.gib(args.budget_bytes)} GiB: {'fits' if est['fits'] else 'DOES NOT FIT'}")
    lines, suggestions = advice_lines(shape, used, est)
    est["suggestions"] = suggestions
    print("\n".join(lines))
    if args.json:
        with reported_write_failure(f"--json {args.json}", Path(args.json).parent):
            write_atomic(args.json, json.dumps(est, indent=2) + "\n")
    if args.out_dir:
        out = Path(args.out_dir)
        with reported_write_failure(f"--out_dir {out}", out), staged_files(out) as tmp:
            written = write_reports(est, tmp, json_name="estimate.json")
        for kind, path in written.items():
            print(f"wrote {kind}: {out / path.name}")
    return 0


if __name__ == "__main__":
    run(main)
