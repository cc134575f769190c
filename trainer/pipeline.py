"""SFT -> reward model -> PPO (and DPO when asked), each stage feeding the next, then evaluation
and a run report. This is what `make demo` runs.

    python -m trainer.pipeline                       # the CPU demo on the embedded SmolLM2
    python -m trainer.pipeline --with_dpo true       # also DPO from the same SFT adapter
    python -m trainer.pipeline --recipe llama2_7b    # the seed recipe (7B, 20k / 50k / 20k, GPU)

A stage whose `results.json` exists is skipped, and a stage that was interrupted resumes from
its newest checkpoint, so rerunning the same command continues where it stopped.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from trainer.config import PROJECT_ROOT, load_yaml

logger = logging.getLogger(__name__)

CONFIG_ROOT = PROJECT_ROOT / "trainer" / "configs"
RECIPES = {"demo": CONFIG_ROOT, "llama2_7b": CONFIG_ROOT / "llama2_7b"}


@dataclass
class PipelineArguments:
    run_dir: str = field(default="runs/demo", metadata={"help": "Folder for every stage's run and the report."})
    recipe: str = field(default="demo", metadata={"help": f"Stage configs: {', '.join(RECIPES)} (or a folder of YAMLs)."})
    with_dpo: bool = field(default=False, metadata={"help": "Also train DPO from the SFT adapter."})
    overrides: str = field(default="", metadata={"help": "Extra 'key=value,...' applied to every stage (e.g. max_steps=2)."})
    eval_prompts: int = field(default=32, metadata={"help": "Held-out prompts for the final policy comparison."})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Response length of the final comparison."})
    samples_in_report: int = field(default=4, metadata={"help": "Side-by-side generations shown in the report."})


def stage_argv(config: Path, run_dir: Path, stage: str, overrides: str, links: dict[str, str]) -> list[str]:
    argv = ["--config", str(config), "--output_dir", str(run_dir / stage)]
    for key, value in links.items():
        argv += [f"--{key}", value]
    for item in filter(None, (o.strip() for o in overrides.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--overrides: '{item}' is not key=value")
        argv += [f"--{key.strip()}", value.strip()]
    return argv


def reset_accelerate() -> None:
    """Each stage makes its own Accelerator; forget the previous stage's singletons."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_stage(name: str, main: Callable[[list[str]], dict], argv: list[str], out: Path) -> dict:
    done = out / "results.json"
    if done.is_file():
        logger.info("stage %s: done already (%s), skipped", name, done)
        return json.loads(done.read_text())
    logger.info("stage %s: %s", name, " ".join(argv))
    reset_accelerate()
    started = time.time()
    results = main(argv)
    results["seconds"] = time.time() - started
    done.write_text(json.dumps(results, indent=2))
    return results


def check_recipe(args: PipelineArguments) -> Path:
    folder = RECIPES.get(args.recipe, Path(args.recipe))
    needed = ["sft", "reward", "ppo"] + (["dpo"] if args.with_dpo else [])
    missing = [s for s in needed if not (folder / f"{s}.yaml").is_file()]
    if missing:
        raise SystemExit(f"recipe '{args.recipe}': no {', '.join(m + '.yaml' for m in missing)} in {folder}")
    # A broken YAML fails here, before hours of training; so do stages that would split the data
    # differently (a PPO prompt could then be one the SFT stage trained on).
    from trainer.config import DataArguments

    defaults = DataArguments()
    splits = {}
    for stage in needed:
        values = load_yaml(folder / f"{stage}.yaml")
        splits[stage] = tuple(values.get(k, getattr(defaults, k)) for k in SPLIT_KEYS)
    if len(set(splits.values())) > 1:
        raise SystemExit(f"recipe '{args.recipe}': the stages must split the data alike ({', '.join(SPLIT_KEYS)}), "
                         f"got {splits}")
    return folder


SPLIT_KEYS = ("dataset", "dataset_split", "dataset_subset", "eval_size", "sft_size", "reward_size", "ppo_size",
              "split_seed")


def main(argv: Optional[list[str]] = None) -> dict:
    from transformers import HfArgumentParser

    from trainer import dpo, ppo, reward, sft

    (args,) = HfArgumentParser(PipelineArguments).parse_args_into_dataclasses(
        args=list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    folder = check_recipe(args)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sft_dir, reward_dir = run_dir / "sft" / "adapter", run_dir / "reward" / "adapter"
    plan = [("sft", sft.main, {}), ("reward", reward.main, {"sft_adapter": str(sft_dir)}),
            ("ppo", ppo.main, {"sft_adapter": str(sft_dir), "reward_adapter": str(reward_dir)})]
    if args.with_dpo:
        plan.append(("dpo", dpo.main, {"sft_adapter": str(sft_dir)}))
    results = {}
    for name, entry, links in plan:
        argv_stage = stage_argv(folder / f"{name}.yaml", run_dir, name, args.overrides, links)
        results[name] = run_stage(name, entry, argv_stage, run_dir / name)
    reset_accelerate()
    from trainer.compare import compare_policies
    from trainer.run_report import write_run_report

    comparison = compare_policies(run_dir, args, with_dpo=args.with_dpo)
    report = write_run_report(run_dir, results, comparison)
    logger.info("run report: %s", report)
    return {"stages": results, "comparison": comparison, "report": str(report)}


if __name__ == "__main__":
    main()
