"""SFT -> reward model -> PPO / GRPO / RLOO (several side by side; DPO when asked), each stage feeding the
next, then the comparison of the policies and a run report: what `make demo` runs, and the one place that
runs stages in order. A finished stage (same settings) is skipped and an interrupted one resumes, so
rerunning the same command continues where it stopped.

    python -m trainer.pipeline [--algorithm ppo,grpo,rloo] [--with_dpo true]   # the CPU demo on SmolLM2
    python -m trainer.pipeline --recipe llama2_7b                              # the seed recipe (7B, GPU)
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Optional, Sequence

from foundation.cli import UsageError, auto_fields, parse, parse_assignments, run
from foundation.config_files import load_yaml
from foundation.files import write_atomic
from foundation.settings import DataArguments
from trainer.config import PIPELINE_STAGES, RECIPES, PipelineArguments, parse_config
from trainer.engine.launch import reset_accelerate
from trainer.engine.setup import COSMETIC_FIELDS, config_changes, run_config

logger = logging.getLogger(__name__)

SPLIT_KEYS = ("dataset", "dataset_split", "dataset_subset", "eval_size", "sft_size", "reward_size", "ppo_size",
              "split_seed")


def stage_module(name: str):
    """A stage's entry module, by name: the pipeline runs entry points, it does not build on them."""
    return importlib.import_module(f"trainer.{name}")


def stage_sections(name: str) -> dict[str, type]:
    """The config sections of stage `name` and their argument classes."""
    from foundation.settings import ModelArguments, TrainArguments

    return {"model": ModelArguments, "data": DataArguments, "train": TrainArguments,
            "stage": stage_module(name).ARGUMENTS}


def stage_fields(module: str) -> set[str]:
    """Every setting a stage's entry module takes (its sections' fields)."""
    return {f.name for cls in stage_sections(module).values() for f in fields(cls)}


# Settings the pipeline gives each stage itself: its folder under --run_dir, and the adapters trained before it there.
PLACED_BY_PIPELINE = ("output_dir", "sft_adapter", "reward_adapter")


def check_overrides(overrides: dict[str, str], stages: Sequence[str]) -> None:
    """Each override goes to the stages that have the setting; one that no stage of this run has is refused, and so
    is one that would move a stage's output, or the adapters it reads, out of --run_dir."""
    placed = [key for key in overrides if key in PLACED_BY_PIPELINE]
    if placed:
        raise UsageError(f"--overrides {', '.join(placed)}: the pipeline sets {'it' if len(placed) == 1 else 'them'} "
                         "(each stage writes into --run_dir/STAGE and reads the adapters the stages before it wrote "
                         "there): choose the folder with --run_dir")
    taken = set().union(*(stage_fields(PIPELINE_STAGES[name][0]) for name in stages))
    unknown = [key for key in overrides if key not in taken]
    if unknown:
        raise UsageError(f"--overrides {', '.join(unknown)}: no stage of this pipeline ({', '.join(stages)}) has "
                         f"{'that setting' if len(unknown) == 1 else 'those settings'}")


def stage_argv(config: Path, out: Path, settings: dict[str, str]) -> list[str]:
    argv = ["--config", str(config), "--output_dir", str(out)]
    for key, value in settings.items():
        argv += [f"--{key}", value]
    return argv


def stages_of(args: PipelineArguments) -> list[str]:
    """The stage folders this pipeline run trains, in order."""
    return ["sft", "reward", *args.trained_policies]


def check_finished_stage(name: str, argv: Sequence[str], out: Path, module: Optional[str] = None) -> None:
    """A finished stage is reused only if it was trained with the settings this run asks for."""
    saved_file = out / "config.json"
    if not saved_file.is_file():
        return
    settings = parse_config(stage_module(module or name).ARGUMENTS, argv)
    now = run_config(*settings, resolved={})
    for section, obj in zip(("model", "data", "train", "stage"), settings):
        for planned in auto_fields(obj):  # left auto: whatever the finished stage's plan chose
            now[section].pop(planned, None)
    changes = config_changes(json.loads(saved_file.read_text()), now, COSMETIC_FIELDS)
    if changes:
        raise UsageError(f"stage {name} in {out} was finished with other settings ({'; '.join(changes)}): rerun with "
                         f"those, use another --run_dir, or delete {out} to train it again")


def run_stage(name: str, argv: list[str], out: Path, module: Optional[str] = None) -> dict:
    """Run one stage's `main` (entry module `module`, else `name`) in this process, unless `out` holds its
    finished results (same settings)."""
    done = out / "results.json"
    if done.is_file():
        check_finished_stage(name, argv, out, module)
        logger.info("stage %s: done already (%s), skipped", name, done)
        return json.loads(done.read_text())
    logger.info("stage %s: %s", name, " ".join(argv))
    reset_accelerate()
    started = time.time()
    try:
        results = stage_module(module or name).main(argv)
    finally:
        release_stage()
    results["seconds"] = time.time() - started
    write_atomic(done, json.dumps(results, indent=2))
    reset_accelerate()
    return results


def release_stage() -> None:
    """Free what a finished stage held before the next one builds its model: its model and optimizer sit in
    reference cycles that only the garbage collector frees (at 7B, a 4 GiB base the next stage would start
    beside), then the device's cached blocks go back, so the next stage's memory report starts from its own."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_recipe(args: PipelineArguments) -> Path:
    folder = RECIPES.get(args.recipe, Path(args.recipe))
    needed = stages_of(args)
    configs = dict.fromkeys(PIPELINE_STAGES[s][1] for s in needed)
    missing = [c for c in configs if not (folder / c).is_file()]
    if missing:
        raise UsageError(f"recipe '{args.recipe}': no {', '.join(missing)} in {folder}")
    # A broken YAML fails here, before hours of training; so do stages that would split the data
    # differently (a PPO prompt could then be one the SFT stage trained on).
    defaults = DataArguments()
    splits = {}
    for stage in needed:
        module, config, _ = PIPELINE_STAGES[stage]
        values = load_yaml(folder / config, stage_sections(module))
        splits[stage] = tuple(values.get(k, getattr(defaults, k)) for k in SPLIT_KEYS)
    if len(set(splits.values())) > 1:
        raise UsageError(f"recipe '{args.recipe}': the stages must split the data alike ({', '.join(SPLIT_KEYS)}), "
                         f"got {splits}")
    return folder


def main(argv: Optional[list[str]] = None) -> dict:
    (args,) = parse([PipelineArguments], list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    overrides = parse_assignments(args.overrides, "overrides")
    check_overrides(overrides, stages_of(args))
    folder = check_recipe(args)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sft_dir, reward_dir = run_dir / "sft" / "adapter", run_dir / "reward" / "adapter"
    online = {"sft_adapter": str(sft_dir), "reward_adapter": str(reward_dir)}
    links = {"sft": {}, "reward": {"sft_adapter": str(sft_dir)}, "dpo": {"sft_adapter": str(sft_dir)},
             **{name: online for name in args.algorithms}}
    results = {}
    for name in stages_of(args):
        module, config, fixed = PIPELINE_STAGES[name]
        takes = stage_fields(module)
        own = {key: value for key, value in overrides.items() if key in takes}
        argv_stage = stage_argv(folder / config, run_dir / name, {**links[name], **own, **fixed})
        results[name] = run_stage(name, argv_stage, run_dir / name, module)
    from trainer.compare import compare_policies
    from trainer.run_report import write_run_report

    comparison = compare_policies(run_dir, args)
    report = write_run_report(run_dir, results, comparison)
    logger.info("run report: %s", report)
    return {"stages": results, "comparison": comparison, "report": str(report)}


if __name__ == "__main__":
    run(main)
