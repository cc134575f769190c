"""The PPO work both sides of the benchmark do: settings, prompts, tokenizer and scalar-head weights.

The settings are the trainer's own argument objects (ModelArguments, DataArguments, TrainArguments,
PPOArguments) plus the few a benchmark adds (`PPOBenchArguments`), parsed by the same parser with
benchmark defaults, so our side runs `rl_step` with exactly the settings objects training uses.
Every prompt has exactly `prompt_length` tokens and every response exactly `max_new_tokens`
(min == max, no early stop), so each step of either side processes the same tensor shapes even
though the two sides group prompts into batches differently.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional, Sequence

import torch

from foundation.cli import Checked, UsageError, at_least, parse, unplanned_defaults
from foundation.settings import DataArguments, ModelArguments, PPOArguments, TrainArguments
from profiling.plan import PLANNABLE
from trainer.engine.settle import check_batch_sizes

logger = logging.getLogger(__name__)

# Llama's linear layers inside a decoder block: what PEFT's "all-linear" selects on a causal LM
# (it leaves out lm_head). Spelled out for the TRL side, where "all-linear" on a sequence-
# classification model would also put LoRA on the `score` head.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

def lora_targets(spec: str) -> list[str]:
    """`lora_target_modules` as TRL's LoraConfig gets it: all-linear spelled out, or the listed modules."""
    if spec == "all-linear":
        return list(LLAMA_LINEARS)
    return [t.strip() for t in spec.split(",") if t.strip()]


# Where a benchmark's defaults differ from training's: a short fixed-length workload, a constant
# learning rate (TRL's PPO loop has no warmup or decay), no LoRA dropout (TRL turns it off), no logs.
# The work itself is set: the settings a stage's budget planner may choose (PLANNABLE) at their values where nothing
# plans them unless the command sets them, so our side's plan (`benchmarks.ours.as_the_stage_plans`) settles only how
# it decodes.
WORK_DEFAULTS = {name: value for cls in (ModelArguments, TrainArguments, PPOArguments)
                 for name, value in unplanned_defaults(cls).items() if name in PLANNABLE}
BENCH_DEFAULTS = {"max_new_tokens": 16, "learning_rate": 5e-5, "warmup_steps": 0, "min_lr_ratio": 1.0,
                  "lora_dropout": 0.0, "report_to": "none", "progress_bar": False, "eval_prompts": 0,
                  "check_budget": False, **WORK_DEFAULTS}


@dataclass
class PPOBenchArguments(Checked):
    """What a benchmark adds to the training settings."""

    prompt_length: int = field(default=32, metadata={"help": "Every prompt has exactly this many tokens."})
    steps: int = field(default=2, metadata={"help": "Measured PPO steps per side."})
    warmup_runs: int = field(default=1, metadata={"help": "Steps run first and left out of the figures."})
    sides: str = field(default="ours,trl", metadata={
        "help": "Which sides to run, in this order: ours, trl, and the ablations of ours: ours_eager_decode "
                "(--decode eager), ours_eager (--compile_layers false); and trl_compiled (TRL with its models' decoder "
                "layers compiled as --compile_layers compiles ours)."})
    rounds: int = field(default=1, metadata={
        "help": "Run every side this many times, the order of --sides reversed every other round (ours,trl then "
                "trl,ours, ...), so a shared machine's drift in speed falls on both sides alike. Figures are over "
                "every round's measured steps; the report lists each round's step times and ratio."})
    out_dir: Optional[str] = field(default=None, metadata={"help": "Default benchmarks/results/ppo_vs_trl-MODEL-DEVICE."})
    isolate: bool = field(default=True, metadata={
        "help": "Run every side, each round, in a fresh Python process of its own (as benchmarks.stages_vs_trl "
                "does). In one process a side ran slower after the other had run - TRL's by up to a quarter on "
                "a 2-core CPU - so false is only for debugging."})
    stop_at: float = field(default=0.0, metadata={
        "help": "Unix time by which every side must have ended (the GPU kit's budget): a side still running then is "
                "stopped and recorded as cut, not as a result, and a side not started by then is cut too. 0: no limit."})
    side_run_out: Optional[str] = field(default=None, metadata={
        "help": "Internal (what --isolate runs): run the one side of --sides once, write its record to this JSON "
                "file and exit."})
    kernel_profile: Optional[str] = field(default=None, metadata={
        "help": "After our side's measured steps, run one more under torch.profiler and write where its time "
                "went (phases' wall and device time, the ops with the most device time) to this folder."})
    export_tokenizer: Optional[str] = field(default=None, metadata={
        "help": "Only write the tokenizer of --model_name_or_path into this folder (for --tokenizer_name_or_path) "
                "and exit."})

    RULES = {"prompt_length": at_least(2), "steps": at_least(1), "warmup_runs": at_least(0), "rounds": at_least(1),
             "stop_at": at_least(0)}


# Our side's ablations: the settings each changes, by part (model: ModelArguments, ppo: PPOArguments).
ABLATIONS = {"ours_eager_decode": {"ppo": {"decode": "eager"}}, "ours_eager": {"model": {"compile_layers": False}}}
# TRL's side with its three models' decoder layers compiled as --compile_layers compiles ours (TRL's PPO
# loop itself compiles nothing): what TRL would gain from it.
TRL_SIDES = ("trl", "trl_compiled")
SIDES = ("ours", *TRL_SIDES, *ABLATIONS)


def part_attribute(workload, name: str) -> Any:
    """`name` read from the first of a workload's parts (its dataclass fields, in order) that has it."""
    for f in fields(workload):
        obj = object.__getattribute__(workload, f.name)
        if hasattr(obj, name):
            return getattr(obj, name)
    raise AttributeError(name)


def parse_parts(stage_class: type, bench_class: type, argv: Sequence[str], defaults: dict) -> tuple:
    """(model, data, train, stage, bench) settings of an online RL comparison: prompts of exactly the bench's
    prompt_length tokens, responses of a fixed length (min_new_tokens = max_new_tokens)."""
    model, data, train, stage, bench = parse([ModelArguments, DataArguments, TrainArguments, stage_class,
                                              bench_class], argv, defaults)
    return (model, replace(data, max_prompt_length=bench.prompt_length), train,
            replace(stage, min_new_tokens=stage.max_new_tokens), bench)


@dataclass(frozen=True)
class Workload:
    """One PPO workload, run by our trainer and by TRL's PPOTrainer in the same process.

    Attributes are looked up in the parts in order (model, data, train, ppo, bench), so `w.lora_r`,
    `w.learning_rate` and `w.rollout_batch_size` read the training settings they name.
    """

    model: ModelArguments
    data: DataArguments
    train: TrainArguments
    ppo: PPOArguments
    bench: PPOBenchArguments

    def __getattr__(self, name: str) -> Any:
        return part_attribute(self, name)

    @classmethod
    def parse(cls, argv: Sequence[str]) -> "Workload":
        return cls(*parse_parts(PPOArguments, PPOBenchArguments, argv, BENCH_DEFAULTS))

    def ablation(self, side: str) -> "Workload":
        """This workload with the settings of ablation `side` (itself for ours and TRL's sides)."""
        changes = ABLATIONS.get(side, {})
        return replace(self, **{part: replace(getattr(self, part), **fields) for part, fields in changes.items()})

    def settings(self) -> dict[str, dict]:
        return {part: asdict(getattr(self, part)) for part in ("model", "data", "train", "ppo", "bench")}

    @property
    def total_steps(self) -> int:
        return self.bench.warmup_runs + self.bench.steps

    @property
    def side_list(self) -> list[str]:
        sides = [s.strip() for s in self.bench.sides.split(",") if s.strip()]
        if set(sides) - set(SIDES) or not sides or len(set(sides)) < len(sides):
            raise UsageError(f"--sides {self.bench.sides!r}: use some of {', '.join(SIDES)}")
        return sides

    def check(self) -> None:
        check_batch_sizes("ppo", self.ppo, self.train.micro_batch_size)
        if self.train.warmup_steps or self.train.min_lr_ratio != 1.0:
            raise UsageError("our side must run a constant learning rate, as TRL's PPO loop does: --warmup_steps 0 "
                             "--min_lr_ratio 1 (--warmup_runs sets the steps left out of the figures)")
        compiled_sides = {"ours_eager", "trl_compiled"} & set(self.side_list)  # raises on an unknown side
        if compiled_sides and not self.model.compile_layers:
            raise UsageError(f"--sides {','.join(sorted(compiled_sides))} compare against --compile_layers true: "
                             "pass it (without it ours_eager is ours, and ours is not compiled like trl_compiled)")

    def lora_targets(self) -> list[str]:
        return lora_targets(self.model.lora_target_modules)

    def tokens(self) -> dict[str, int]:
        """Token counts of one step, the same for both sides."""
        b, p, r = self.ppo.rollout_batch_size, self.bench.prompt_length, self.ppo.max_new_tokens
        return {"generated": b * r, "update": b * (p + r) * self.ppo.ppo_epochs}


def trl_batch_settings(args: Workload) -> dict[str, int]:
    """PPOConfig fields giving TRL the same rollout, minibatch and micro-batch sizes.

    TRL's rollout batch is per_device_train_batch_size x gradient_accumulation_steps, split into
    num_mini_batches minibatches of micro-batches of per_device_train_batch_size rows.
    """
    return {"per_device_train_batch_size": args.micro_batch_size,
            "gradient_accumulation_steps": args.rollout_batch_size // args.micro_batch_size,
            "num_mini_batches": args.rollout_batch_size // args.mini_batch_size,
            "local_rollout_forward_batch_size": args.rollout_micro_batch_size,
            "num_ppo_epochs": args.ppo_epochs}


def load_bench_tokenizer(args):
    """The model's tokenizer (or --tokenizer_name_or_path's), folded into a preset's vocabulary as in training;
    `args`: a workload, or the ModelArguments themselves."""
    from trainer.model.loading import load_tokenizer

    return load_tokenizer(args.model_name_or_path, args.preset_overrides, args.tokenizer_name_or_path,
                          args.trust_remote_code)


def export_tokenizer(args: Workload) -> None:
    """Write the tokenizer files (a few MB) that --tokenizer_name_or_path reads, e.g. into an ignored .data/ folder."""
    tokenizer = load_bench_tokenizer(args)
    inner = getattr(tokenizer, "_tok", tokenizer)  # a FoldedTokenizer saves the tokenizer it borrows
    inner.save_pretrained(args.bench.export_tokenizer)
    logger.info("tokenizer of %s written to %s", args.model_name_or_path, args.bench.export_tokenizer)


def fixed_length_prompts(args: Workload, tokenizer, count: int) -> list[list[int]]:
    """`count` hh-rlhf PPO prompts of exactly `prompt_length` tokens (left-truncated as in training).

    Prompts shorter than that, or holding the pad id anywhere (TRL reads pad ids as padding), are
    left out, so no batch of either side needs padding.
    """
    from trainer.data.hh_rlhf import load_pairs, split_pairs
    from trainer.data.tokenization import tokenize_prompts

    data_args = replace(args.data, eval_size=0, sft_size=0, reward_size=0,
                        max_length=max(512, args.prompt_length + 1))
    pairs, _ = load_pairs(data_args)
    data_args = replace(data_args, ppo_size=len(pairs))  # every prompt is a candidate: the length filter is strict
    candidates = split_pairs(pairs, data_args).ppo
    pad, kept = tokenizer.pad_token_id, []
    for start in range(0, len(candidates), 512):  # in the split's order, until there are enough
        examples, _ = tokenize_prompts(candidates[start : start + 512], tokenizer, data_args)
        kept += [e.prompt_ids for e in examples if len(e.prompt_ids) == args.prompt_length and pad not in e.prompt_ids]
        if len(kept) >= count:
            break
    if len(kept) < count:
        raise UsageError(f"only {len(kept)} hh-rlhf prompts have {args.prompt_length} tokens or more; need {count}: "
                         "lower --prompt_length, --steps or --rollout_batch_size")
    return kept[:count]


def hidden_size(args: Workload, vocab_size: int) -> int:
    from transformers import AutoConfig

    from profiling.shapes import PRESETS, preset_config
    from trainer.model.loading import resolve_model_path

    if args.model_name_or_path in PRESETS:
        return preset_config(args.model_name_or_path, vocab_size, args.preset_overrides).hidden_size
    return AutoConfig.from_pretrained(str(resolve_model_path(args.model_name_or_path)),
                                      trust_remote_code=args.trust_remote_code).hidden_size


def head_weights(hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Initial (1, hidden) weights of the value and reward heads, loaded into both sides.

    With the same base weights, an untrained reward head and the value head's start identical on
    both sides, the two compute the same reward and initial value functions (bias 0).
    """
    gen = torch.Generator().manual_seed(seed + 7919)
    std = 1.0 / (hidden_size + 1) ** 0.5  # trainer.model.shared_base.ScalarHead's init
    return {name: torch.randn(1, hidden_size, generator=gen) * std for name in ("value", "reward")}


def write_heads(heads: dict[str, torch.Tensor], folder) -> dict[str, str]:
    """Save each head weight (bias 0) as a `head.safetensors` in `folder/NAME/`: our side loads its value
    and reward heads from these files, as a run loads a trained reward head."""
    from pathlib import Path

    from safetensors.torch import save_file

    from trainer.model.adapter_fit import HEAD_FILE

    out = {}
    for name, weight in heads.items():
        path = Path(folder) / name
        path.mkdir(parents=True, exist_ok=True)
        save_file({"linear.weight": weight.float().contiguous(), "linear.bias": torch.zeros(1)}, str(path / HEAD_FILE))
        out[name] = str(path)
    return out
