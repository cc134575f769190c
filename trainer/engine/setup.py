"""What every stage does before its loop, in an order that fails fast: parse and check the settings,
make the Accelerator, check the output folder and the adapters named, load the tokenizer, check the
memory estimate, load and split the data, then decide what the run continues. No model is loaded here;
a stage checks its tokenized rows (`require_rows`) before it builds one.

And what it does after: save the final adapter and results.json (`finish_stage`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from accelerate.utils import set_seed

from foundation.cli import AUTO, FieldError, InputError, UsageError, unplanned_defaults
from foundation.files import entry_problem, reported_write_failure, write_atomic
from foundation.reward_specs import split_specs
from foundation.run_plan import RunPlan
from foundation.settings import ONLINE_RL_STAGES, DataArguments, ModelArguments, RolloutArguments, TrainArguments
from trainer.config import parse_config
from trainer.data.formats import parser_for
from trainer.data.hh_rlhf import LoadReport, Splits, load_splits
from trainer.engine.budget import context_at_start, outside_allocator_gib
from trainer.engine.checkpoint import (
    PREFIX, RUN_ARTIFACTS, gathered_trainable, remove_save_debris, saved_config,
    select_checkpoint, set_aside_newer, set_aside_previous_run,
)
from trainer.engine.harness import TrainingDiverged
from trainer.engine.launch import (
    ALLOC_CONF, Launch, check_launch, is_deepspeed, make_accelerator, quant_storage_for, set_allocator_defaults,
    setup_logging,
)
from trainer.engine.settle import check_combinations, settle
from trainer.engine.metrics import eval_history, largest_weight, unusable_weights
from trainer.engine.run_lock import LOCK_FILE, RunLock, RunLocked, planted
from trainer.model.adapter_fit import BASE_MODEL_FILE, base_identity, saved_base
from trainer.model.loading import TORCH_DTYPES, load_tokenizer, max_positions
from trainer.model.shared_base import build_shared_model, check_adapter_folder
from trainer.rl.rewards import source_hashes

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


@dataclass
class RunContext:
    model_args: ModelArguments
    data_args: DataArguments
    train_args: TrainArguments
    stage_args: Any
    accelerator: Any
    tokenizer: Any
    splits: Splits
    plan: RunPlan  # every memory and speed choice, settled at start (`trainer.engine.settle`)
    resolved: dict[str, Any] = field(default_factory=dict)  # what "auto" settings became (the data source)
    resume_from: Optional[Path] = None  # the verified checkpoint this run continues, if any
    lock: Optional[RunLock] = None  # rank 0's lock on output_dir, released by finish_stage

    @property
    def output_dir(self) -> Path:
        return Path(self.train_args.output_dir)

    def quant_storage(self) -> torch.dtype:
        """The storage dtype of the 4-bit base's packed weights under this launch (see quant_storage_for)."""
        return quant_storage_for(TORCH_DTYPES[self.plan.dtype], self.accelerator)

    def require_batch(self, rows: Sequence, what: str) -> None:
        """Stop before any model loads when tokenization left fewer training rows than one micro-batch."""
        require_rows(rows, what, self.plan.micro_batch_size, self.data_args)

    def build_model(self, specs: list, model_args: Optional[ModelArguments] = None):
        """The stage's adapters `specs` on one base (`trainer.model.shared_base`), built as the plan says, from
        `model_args` where a stage changes the run's (online RL: no LoRA dropout)."""
        return build_shared_model(model_args or self.model_args, specs, vocab_size=len(self.tokenizer),
                                  device=self.accelerator.device, quant_storage=self.quant_storage(), plan=self.plan)

    def config(self) -> dict[str, Any]:
        """The run's settings as plain JSON data: config.json, and every checkpoint's copy of it."""
        return run_config(self.model_args, self.data_args, self.train_args, self.stage_args, self.resolved, self.plan)


def run_config(model_args, data_args, train_args, stage_args, resolved: dict[str, Any],
               plan: Optional[RunPlan] = None) -> dict[str, Any]:
    """The settings as asked (model, data, train, stage), what the run settled them to (plan) and the facts
    it resolved (resolved) as plain JSON data."""
    sections = {"model": model_args, "data": data_args, "train": train_args, "stage": stage_args}
    record = {**{k: asdict(v) for k, v in sections.items()}, "resolved": resolved}
    return json.loads(json.dumps(record | ({"plan": plan.record()} if plan else {})))


ADAPTER_STAGES = {"sft_adapter": "sft", "reward_adapter": "reward"}  # the stage that makes each adapter setting's


def check_adapter_paths(stage_args) -> None:
    """Every `*_adapter` setting must name a saved adapter: say which one is wrong, at start; for an
    absent one, the command that makes it (stages run in order only through the pipeline)."""
    for f in fields(stage_args):
        path = getattr(stage_args, f.name)
        if f.name.endswith("_adapter") and path is not None:
            if f.name in ADAPTER_STAGES and not Path(path).exists():
                raise InputError(missing_adapter(f.name, Path(path)))
            check_adapter_folder(path, f"--{f.name}")


def missing_adapter(setting: str, path: Path) -> str:
    """One line: the absent adapter folder of `--setting`, and the commands that make it."""
    stage = ADAPTER_STAGES[setting]
    out = path.parent if path.name == "adapter" else "DIR"
    where = "" if path.name == "adapter" else " (its adapter is DIR/adapter)"
    return (f"--{setting}: {path} is not a saved adapter (no such folder): make it with `python -m trainer.pipeline` "
            f"(every stage in order) or `python trainer/{stage}.py --config trainer/configs/{stage}.yaml "
            f"--output_dir {out}`{where}")


def check_output_dir(path: Path) -> None:
    """The run folder can be created and written, or the run stops before loading anything."""
    import os

    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"  # one per process: ranks check the same folder at once
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--output_dir {path}: cannot write there ({exc.strerror or exc}); pick a writable folder") \
            from None


RUN_FOLDERS = ("adapter", "tensorboard")  # of the run's outputs (RUN_ARTIFACTS), the folders; the rest are files


def check_run_entries(path: Path) -> None:
    """Each entry the run writes into its folder is absent, a regular file or a real folder as it should be: a
    link would send the run's writes (metrics, events, config) outside the folder, a FIFO would hang them, a
    folder where a file goes would fail them. One line before the run writes anything."""
    checkpoints = [p.name for p in path.iterdir() if p.name.startswith(PREFIX)]
    for name in (*RUN_ARTIFACTS, LOCK_FILE, *checkpoints):
        problem = entry_problem(path / name, folder=name in RUN_FOLDERS or name in checkpoints)
        if problem:
            raise UsageError(planted(path, path / name, problem))


def lock_output_dir(accelerator, path: Path) -> Optional[RunLock]:
    """Rank 0 locks the run folder (`RunLock`); every rank stops alike when another run holds it."""
    lock, problem = None, None
    if accelerator.is_main_process:
        try:
            lock = RunLock.acquire(path)
        except RunLocked as exc:
            problem = str(exc)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem])[0]
    if problem:
        raise RunLocked(problem)
    return lock


def check_positions(stage: Optional[str], model_args, data_args, stage_args, vocab_size: int) -> None:
    """The longest sequence a stage builds must fit the base model's positions: max_length for SFT, reward and
    DPO (a shared-prompt pair's completions both start after the prompt), prompt plus response for PPO / GRPO."""
    if stage is None:
        return
    positions = max_positions(model_args, vocab_size)
    if positions is None:
        return
    where = f"the {positions} positions of {model_args.model_name_or_path} (max_position_embeddings)"
    if stage in ONLINE_RL_STAGES:
        longest = data_args.max_prompt_length + stage_args.max_new_tokens
        if longest > positions:
            raise UsageError(f"--max_prompt_length {data_args.max_prompt_length} + --max_new_tokens "
                             f"{stage_args.max_new_tokens} = {longest} tokens exceed {where}: lower them to "
                             f"{positions} in all")
    elif data_args.max_length > positions:
        raise UsageError(f"--max_length {data_args.max_length} exceeds {where}: use at most {positions}")


def simulate_gpu_memory(gib: float, device) -> None:
    """Make a larger GPU behave like a card of `gib` GiB: PyTorch's allocator is capped at what such a card
    leaves it beside the memory CUDA holds outside it (`outside_allocator_gib`), so that an out-of-memory
    error happens where it would on that card and the device memory the run holds stays within `gib`."""
    if gib <= 0:
        return
    if device.type != "cuda":
        logger.info("simulate_gpu_gib=%s ignored: no CUDA device", gib)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has none
    total = torch.cuda.get_device_properties(index).total_memory
    outside, what = outside_allocator_gib(device)
    if gib <= outside:
        raise UsageError(f"--simulate_gpu_gib {gib:g}: CUDA alone holds {outside:.2f} GiB outside the allocator "
                         f"({what}); simulate a larger card")
    fraction = min(1.0, (gib - outside) * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    logger.info("CUDA memory capped as a %g GiB card: the allocator gets %.2f GiB (%.3f of %.1f GiB), %.2f GiB "
                "left to %s", gib, fraction * total / 2**30, fraction, total / 2**30, outside, what)


# Fields that change nothing a run computes (only where it writes, how long it runs, what it logs).
COSMETIC_FIELDS = {
    "train": {"output_dir", "resume", "resume_config_check", "log_every", "report_to", "progress_bar",
              "profile_memory", "check_budget", "memory_budget_gib", "simulate_gpu_gib", "keep_checkpoints",
              "max_bad_steps"},
}
# A resumed run may also lengthen itself and evaluate or save differently.
RESUME_SAFE_FIELDS = {"train": COSMETIC_FIELDS["train"] | {"max_steps", "eval_every", "eval_batches",
                                                           "eval_batch_size", "save_every"},
                      # how rollouts decode: speed, not what is sampled (the same distribution and log-probs)
                      "stage": {"decode", "generation_weights"}, "plan": {"decode", "generation_weights"},
                      "resolved": {"reward_files"}}  # an edited reward file is said (warn_edited_rewards), not refused


def reward_sources(stage_args) -> dict[str, Any]:
    """{"reward_files": {file or module: hash}} of a stage scored by reward functions, else {}."""
    sources = source_hashes(split_specs(getattr(stage_args, "reward_fn", None)))
    return {"reward_files": sources} if sources else {}


def warn_edited_rewards(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A run resumed with reward functions whose source changed since its checkpoint: one warning per file."""
    before = (saved.get("resolved") or {}).get("reward_files") or {}
    for source, digest in ((now.get("resolved") or {}).get("reward_files") or {}).items():
        if source in before and before[source] != digest:
            logger.warning("reward functions in %s changed since the checkpoint this run resumes: the steps and "
                           "evaluations before and after it are scored by different functions", source)


# A planned true/false or number setting compares as its value where nothing plans it: auto and that value ask for
# the same run; what a planner chose is compared in the "plan" section.
UNPLANNED_VALUES = {**unplanned_defaults(ModelArguments), **unplanned_defaults(TrainArguments),
                    **unplanned_defaults(RolloutArguments)}


def _asked(key: str, value: Any) -> Any:
    return UNPLANNED_VALUES.get(key, value) if value == AUTO else value


def config_changes(saved: dict[str, Any], now: dict[str, Any], allowed: dict[str, set[str]]) -> list[str]:
    """'section.field: saved -> now' for every field that differs, but those in `allowed` (evaluation-only
    stage fields, like eval_prompts, may always change; fields absent from the saved file are not compared)."""
    changes = []
    for section, values in now.items():
        old_values = saved.get(section) or {}
        for key, value in values.items():
            if key not in old_values or key in allowed.get(section, set()):
                continue
            if section == "stage" and key.startswith("eval"):
                continue
            if _asked(key, old_values[key]) != _asked(key, value):
                changes.append(f"{section}.{key}: {old_values[key]!r} -> {value!r}")
    return changes


def resume_config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return config_changes(saved, now, RESUME_SAFE_FIELDS)


def check_resume_config(ctx: RunContext) -> None:
    """Stop if the run would continue its checkpoint under other settings than the checkpoint was saved with."""
    if ctx.resume_from is None or not ctx.train_args.resume_config_check:
        return
    saved = saved_config(ctx.resume_from)
    if saved is None:  # a checkpoint of an older version: the folder's config.json is the best record
        folder_config = ctx.output_dir / CONFIG_FILE
        try:
            saved = json.loads(folder_config.read_text()) if folder_config.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{folder_config}: not valid JSON ({exc}); resume with --resume_config_check false "
                             "or start over with --resume no") from None
    now = ctx.config()
    changes = resume_config_changes(saved, now)
    warn_edited_rewards(saved, now)
    old_steps = (saved.get("train") or {}).get("max_steps")
    if old_steps not in (None, ctx.train_args.max_steps):
        logger.warning("max_steps %s -> %s: the learning-rate schedule is stretched to the new length, so the "
                       "rate jumps at the first resumed step", old_steps, ctx.train_args.max_steps)
    if changes:
        raise UsageError(
            f"{ctx.output_dir} would resume from {ctx.resume_from.name}, which was saved with other settings: "
            f"{'; '.join(changes)}. Rerun with the saved values, start over with --resume no (or another "
            "--output_dir), or resume anyway with --resume_config_check false")


def prepare_output_dir(ctx: RunContext) -> None:
    """Decide what this run continues: set an earlier run aside (`--resume no`) or pick and verify the
    checkpoint to resume, check its settings, then record this run's settings in config.json."""
    accelerator = ctx.accelerator
    if accelerator.is_main_process:
        remove_save_debris(ctx.output_dir)  # safe: this run holds the folder's lock
    if ctx.train_args.resume == "no" and accelerator.is_main_process:
        set_aside_previous_run(ctx.output_dir)
    accelerator.wait_for_everyone()
    ctx.resume_from = select_checkpoint(ctx.output_dir, ctx.train_args.resume, is_deepspeed(accelerator),
                                        ctx.train_args.max_steps)
    check_resume_config(ctx)
    if ctx.resume_from is not None and accelerator.is_main_process and \
            ctx.resume_from.parent.resolve() == ctx.output_dir.resolve():
        set_aside_newer(ctx.output_dir, ctx.resume_from)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with reported_write_failure(str(ctx.output_dir / CONFIG_FILE), ctx.output_dir):
            write_atomic(ctx.output_dir / CONFIG_FILE, json.dumps(ctx.config(), indent=2))


def start_run(stage_args_cls: type, argv: Optional[Sequence[str]] = None, stage: Optional[str] = None) -> RunContext:
    """Parse and check everything a stage needs (settings, folders, adapters, budget, data) before any model."""
    import sys

    model_args, data_args, train_args, stage_args = parse_config(stage_args_cls, sys.argv[1:] if argv is None else argv)
    allocator = set_allocator_defaults()
    accelerator = make_accelerator(train_args)
    setup_logging(accelerator)
    if allocator:
        logger.info("%s=%s: the CUDA allocator grows segments in place (set %s to choose otherwise)", ALLOC_CONF,
                    allocator, ALLOC_CONF)
    check_launch(accelerator, stage)
    launch = Launch.of(accelerator)
    check_combinations(model_args, stage_args, launch)  # before the folders: nothing written yet
    check_output_dir(Path(train_args.output_dir))
    check_run_entries(Path(train_args.output_dir))
    lock = lock_output_dir(accelerator, Path(train_args.output_dir))
    set_seed(train_args.seed)
    context_at_start(accelerator.device)  # measured now, before any model: what the estimate and the cap use
    simulate_gpu_memory(train_args.simulate_gpu_gib, accelerator.device)
    check_adapter_paths(stage_args)
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                               model_args.tokenizer_name_or_path, model_args.trust_remote_code)
    check_positions(stage, model_args, data_args, stage_args, len(tokenizer))
    plan = settle(stage, (model_args, data_args, train_args, stage_args), accelerator.device, launch)
    splits, report = load_splits(data_args, parser_for(data_args, tokenizer))
    check_split(stage, splits, report, data_args, plan, stage_args)
    ctx = RunContext(model_args, data_args, train_args, stage_args, accelerator, tokenizer, splits, plan,
                     resolved={"dataset_fingerprint": report.fingerprint, **reward_sources(stage_args)}, lock=lock)
    prepare_output_dir(ctx)
    return ctx


STAGE_SUBSETS = {"sft": "sft", "reward": "reward", "dpo": "reward", "ppo": "ppo", "grpo": "ppo"}  # what each trains on


def check_split(stage: Optional[str], splits: Splits, report: LoadReport, data_args: DataArguments,
                plan: RunPlan, stage_args) -> None:
    """Stop at start when the data held enough usable pairs but the prompt-disjoint split left the stage's
    subset short of one batch (few distinct prompts: eval takes whole prompts, ppo one pair a prompt), so the
    message names the prompts rather than skipped rows (`require_rows` says those)."""
    subset = STAGE_SUBSETS.get(stage or "")
    if subset is None:
        return
    needed = stage_args.rollout_batch_size if subset == "ppo" else plan.micro_batch_size
    rows = getattr(splits, subset)
    requested = getattr(data_args, f"{subset}_size")
    if len(rows) >= needed or requested < needed or report.kept < len(splits.eval) + needed:
        return
    raise InputError(f"{report.dataset}: the prompt-disjoint split left too few prompts for {stage}: "
                     f"{splits.prompts} distinct prompt(s) in {report.kept} usable pairs, eval took "
                     f"{splits.eval_prompts}, leaving {len(rows)} {subset} rows where one batch needs {needed}; "
                     "use data with more distinct prompts or a smaller --eval_size")


def require_rows(rows: Sequence, what: str, needed: int, data_args: DataArguments) -> None:
    """Stop before any model loads when tokenization left fewer rows than one batch needs."""
    if len(rows) < needed:
        raise InputError(f"{what}: {len(rows)} usable rows from {data_args.dataset}, and one batch needs {needed} "
                         "(the data log above says how many were skipped and why); use more data, a larger "
                         "max_length or a smaller batch")


def save_final_adapter(ctx: RunContext, model, adapter: str, folder: str = "adapter") -> Optional[Path]:
    """The stage's product in PEFT format, with the base-model settings needed to load it again."""
    ctx.accelerator.wait_for_everyone()
    unwrapped = ctx.accelerator.unwrap_model(model)
    with gathered_trainable(ctx.accelerator, unwrapped):  # ZeRO-3 partitions them: every rank gathers
        if not ctx.accelerator.is_main_process:
            return None
        out = unwrapped.save_adapter(adapter, ctx.output_dir / folder)
    trained_on = {"quantization": ctx.plan.quantization, "dtype": ctx.plan.dtype}  # what trainer.export rebuilds
    record = {**asdict(ctx.model_args), "trained_on": trained_on, **base_identity(unwrapped.causal_lm)}
    write_atomic(out / BASE_MODEL_FILE, json.dumps(record, indent=2))
    logger.info("saved the %s adapter to %s", adapter, out)
    return out


def base_model_args(adapter_dir: str | Path, trust_remote_code: bool = False,
                    allow_with: str = "--trust_remote_code true", **overrides) -> ModelArguments:
    """The ModelArguments an adapter was trained with (its base_model.json, or a checkpoint's config.json),
    with overrides. `trust_remote_code` is the command line's alone (`allow_with` says how to give it): a
    saved file that asks for it is refused, since an adapter from elsewhere could otherwise run its own Python."""
    values, path = saved_base(adapter_dir)
    if path is None:
        logger.warning("%s has no %s (nor a run config.json above it): assuming the default base %s",
                       adapter_dir, BASE_MODEL_FILE, ModelArguments().model_name_or_path)
    if values.get("trust_remote_code") not in (None, False) and not trust_remote_code:
        raise InputError(f"{path}: asks for trust_remote_code (the base model's own Python code would run); "
                         f"only the command line can allow it: pass {allow_with} if you trust that model")
    values.update({k: v for k, v in overrides.items() if v is not None}, trust_remote_code=trust_remote_code)
    known = {f.name for f in fields(ModelArguments)}
    try:
        return ModelArguments(**{k: v for k, v in values.items() if k in known})
    except FieldError as exc:  # a saved value of the wrong kind: name the file, not a flag
        if path is None or overrides.get(exc.name) is not None:
            raise
        raise InputError(f"{path}: {exc.name}: {exc.value!r} {exc.problem}") from None


def finish_stage(ctx: RunContext, stage: str, model, adapter: str, **facts: Any) -> dict[str, Any]:
    """Save the stage's adapter and write results.json: facts plus the first and last evaluation; then free
    the run folder's lock. NaN, inf or overflowing weights are never saved (the harness stops at the step
    that made them; this is the last guard)."""
    weights = ctx.accelerator.unwrap_model(model).trainable_parameters()
    problem = unusable_weights(largest_weight(ctx.accelerator, weights))
    if problem:
        raise TrainingDiverged(f"the trained adapters hold {problem}: not saved to {ctx.output_dir / 'adapter'}")
    with reported_write_failure(f"the final adapter in {ctx.output_dir}", ctx.output_dir):
        path = save_final_adapter(ctx, model, adapter)
    evals = eval_history(ctx.output_dir)
    results = {"stage": stage, "adapter": str(path), **facts,
               "eval_before": evals[0] if evals else None, "eval_after": evals[-1] if evals else None}
    if ctx.accelerator.is_main_process:
        with reported_write_failure(str(ctx.output_dir / "results.json"), ctx.output_dir):
            write_atomic(ctx.output_dir / "results.json", json.dumps(results, indent=2))
        logger.info("results: %s", json.dumps(results))
    if ctx.lock is not None:
        ctx.lock.release()
    return results
