"""The one way a stage reads its settings: a YAML file with `model:`, `data:`, `train:` and `stage:` sections,
then `--field value` flags over it. The argument dataclasses every stage shares are declared in
`foundation.settings` (so the memory estimator reads the same ones); the pipeline's are here.

    accelerate launch trainer/sft.py --config trainer/configs/sft.yaml --max_steps 200

Each section holds only its own dataclass's fields; an unknown section or key, a value of the wrong
type, or one outside its range stops the run at start with one line naming it (`foundation.cli`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from foundation.cli import Checked, at_least, parse
from foundation.config_files import config_flag, load_yaml
from foundation.settings import DataArguments, ModelArguments, TrainArguments

# Where the shared hh-rlhf rows live on the development machines, relative to the project root.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG_ROOT = PROJECT_ROOT / "trainer" / "configs"
RECIPES = {"demo": CONFIG_ROOT, "llama2_7b": CONFIG_ROOT / "llama2_7b"}  # --recipe NAME: its config folder
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data" / "hh-rlhf"
CACHE_ENV = "RLHF_CACHE"


def cache_dir() -> Path:
    """Folder for converted models and other derived files ($RLHF_CACHE, else ~/.cache/onebase-rlhf)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onebase-rlhf"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


# A pipeline stage, in a run's order: its folder -> (entry module, config file of the recipe, settings it always
# gets). RLOO is the GRPO stage with the leave-one-out advantage, in a folder of its own.
PIPELINE_STAGES = {"sft": ("sft", "sft.yaml", {}), "reward": ("reward", "reward.yaml", {}),
                   "ppo": ("ppo", "ppo.yaml", {}), "grpo": ("grpo", "grpo.yaml", {}),
                   "rloo": ("grpo", "grpo.yaml", {"advantage": "rloo"}), "dpo": ("dpo", "dpo.yaml", {})}


@dataclass
class PipelineArguments(Checked):
    """`trainer.pipeline` (every stage, then the comparison and the report) and `trainer.compare`."""

    run_dir: str = field(default="runs/demo", metadata={"help": "Folder for every stage's run and the report."})
    recipe: str = field(default="demo", metadata={"help": "Stage configs: demo, llama2_7b (or a folder of YAMLs)."})
    algorithm: str = field(default="ppo", metadata={
        "help": "Online RL after the reward model: ppo, grpo, rloo, or several comma-separated (ppo,grpo,rloo), each "
                "from the same SFT and reward adapters into its own folder."})
    with_dpo: bool = field(default=False, metadata={"help": "Also train DPO from the SFT adapter."})
    overrides: str = field(default="", metadata={
        "help": "Settings as key=value,key=value (e.g. max_steps=2), each given to the stages that have it; a value "
                "may be a list: reward_fn=keyword:thanks,length:24,reward_weights=1.0,0.5,max_steps=2."})
    eval_prompts: int = field(default=32, metadata={"help": "Held-out prompts for the final policy comparison."})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Response length of the final comparison."})
    samples_in_report: int = field(default=4, metadata={"help": "Side-by-side generations shown in the report."})

    RULES = {"eval_prompts": at_least(1), "eval_max_new_tokens": at_least(1), "samples_in_report": at_least(0),
             "algorithm": lambda name, value: _online_algorithms_rule(value),
             "run_dir": lambda name, value: _folder_rule(value)}

    @property
    def algorithms(self) -> list[str]:
        """The online RL stages asked for, in the order given."""
        return [a.strip() for a in self.algorithm.split(",") if a.strip()]

    @property
    def trained_policies(self) -> list[str]:
        """The policies the run trains after SFT and the reward model (its stage folders, in order)."""
        return self.algorithms + (["dpo"] if self.with_dpo else [])


def _folder_rule(value: str) -> Optional[str]:
    """A folder a command reads and writes: neither it nor a folder above it may be an existing file."""
    path = Path(value).expanduser()
    blocker = next((p for p in (path, *path.parents) if p.is_file()), None)
    if blocker is None:
        return None
    return "is a file; name a folder" if blocker == path else f"lies under {blocker}, which is a file; name a folder"


ONLINE_ALGORITHMS = ("ppo", "grpo", "rloo")


def _online_algorithms_rule(value: str) -> Optional[str]:
    names = [a.strip() for a in value.split(",") if a.strip()]
    unknown = [a for a in names if a not in ONLINE_ALGORITHMS]
    if not names or unknown or len(set(names)) != len(names):
        return f"must be one or more of {', '.join(ONLINE_ALGORITHMS)}, comma-separated, each once"
    return None


def parse_config(stage_cls: type, argv: Sequence[str]) -> tuple[ModelArguments, DataArguments, TrainArguments, Any]:
    """`--config file.yaml` (optional) plus flags into the four argument objects of a stage."""
    config_path, argv = config_flag(argv)
    types = {"model": ModelArguments, "data": DataArguments, "train": TrainArguments, "stage": stage_cls}
    defaults = load_yaml(config_path, types) if config_path else {}
    return parse(list(types.values()), argv, defaults, config_path)
