"""What every stage script does before its loop: parse configs, make the Accelerator, load data."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from accelerate.utils import set_seed

from trainer.config import DataArguments, ModelArguments, TrainArguments, parse_config
from trainer.budget import check_budget
from trainer.checkpoint import CheckpointError, gathered_trainable, saved_config, select_checkpoint, set_aside_previous_run
from trainer.data import DataError, Splits, load_splits
from trainer.launch import check_launch
from trainer.loop import make_accelerator, setup_logging
from trainer.models import ModelLoadError, load_tokenizer

logger = logging.getLogger(__name__)

BASE_MODEL_FILE = "base_model.json"  # beside a saved adapter: how to rebuild the base it sits on


@dataclass
class RunContext:
    model_args: ModelArguments
    data_args: DataArguments
    train_args: TrainArguments
    stage_args: Any
    accelerator: Any
    tokenizer: Any
    splits: Splits
    resolved: dict[str, Any] = field(default_factory=dict)  # what "auto" settings became (the data source)
    resume_from: Optional[Path] = None  # the verified checkpoint this run continues, if any

    @property
    def output_dir(self) -> Path:
        return Path(self.train_args.output_dir)

    def config(self) -> dict[str, Any]:
        """The run's settings as plain JSON data: config.json, and every checkpoint's copy of it."""
        sections = {"model": self.model_args, "data": self.data_args, "train": self.train_args, "stage": self.stage_args}
        return json.loads(json.dumps({**{k: asdict(v) for k, v in sections.items()}, "resolved": self.resolved}))


def check_adapter_paths(stage_args) -> None:
    """Every `*_adapter` setting must name a saved adapter: say which one is missing, at start."""
    for f in fields(stage_args):
        path = getattr(stage_args, f.name)
        if f.name.endswith("_adapter") and path is not None and not (Path(path) / "adapter_config.json").is_file():
            raise SystemExit(f"--{f.name} {path}: no saved adapter there (adapter_config.json missing); "
                             "run the stage that produces it first, or fix the path")


def simulate_gpu_memory(gib: float, device) -> None:
    """Cap the CUDA caching allocator at `gib` GiB, so a larger GPU behaves like a smaller card."""
    if gib <= 0:
        return
    import torch

    if device.type != "cuda":
        logger.info("simulate_gpu_gib=%s ignored: no CUDA device", gib)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    logger.info("CUDA memory capped at %.1f GiB (%.3f of %.1f GiB)", gib, fraction, total / 2**30)


# Fields a resumed run may change without leaving the trajectory it was on (or only lengthening it).
RESUME_SAFE_FIELDS = {
    "train": {"output_dir", "resume", "resume_config_check", "max_steps", "eval_every", "eval_batches", "save_every",
              "keep_checkpoints", "log_every", "report_to", "progress_bar", "profile_memory", "check_budget",
              "memory_budget_gib", "simulate_gpu_gib", "max_bad_steps"},
}


def resume_config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'section.field: saved -> now' for every field a resume must not change (evaluation-only stage
    fields, like eval_prompts, may change; fields absent from the saved file are not compared)."""
    changes = []
    for section, values in now.items():
        old_values = saved.get(section) or {}
        for key, value in values.items():
            if key not in old_values or key in RESUME_SAFE_FIELDS.get(section, set()):
                continue
            if section == "stage" and key.startswith("eval"):
                continue
            if old_values[key] != value:
                changes.append(f"{section}.{key}: {old_values[key]!r} -> {value!r}")
    return changes


def check_resume_config(ctx: "RunContext") -> None:
    """Stop if the run would continue its checkpoint under other settings than the checkpoint was saved with."""
    if ctx.resume_from is None or not ctx.train_args.resume_config_check:
        return
    saved = saved_config(ctx.resume_from)
    if saved is None:  # a checkpoint of an older version: the folder's config.json is the best record
        folder_config = ctx.output_dir / "config.json"
        saved = json.loads(folder_config.read_text()) if folder_config.is_file() else {}
    changes = resume_config_changes(saved, ctx.config())
    if changes:
        raise SystemExit(
            f"{ctx.output_dir} would resume from {ctx.resume_from.name}, which was saved with other settings: "
            f"{'; '.join(changes)}. Rerun with the saved values, start over with --resume no (or another "
            "--output_dir), or resume anyway with --resume_config_check false")


def prepare_output_dir(ctx: "RunContext") -> None:
    """Decide what this run continues: set an earlier run aside (`--resume no`) or pick and verify the
    checkpoint to resume, check its settings, then record this run's settings in config.json."""
    from trainer.launch import is_deepspeed

    accelerator = ctx.accelerator
    if ctx.train_args.resume == "no" and accelerator.is_main_process:
        set_aside_previous_run(ctx.output_dir)
    accelerator.wait_for_everyone()
    try:
        ctx.resume_from = select_checkpoint(ctx.output_dir, ctx.train_args.resume, is_deepspeed(accelerator))
    except CheckpointError as exc:
        raise SystemExit(f"CheckpointError: {exc}") from None
    check_resume_config(ctx)
    if accelerator.is_main_process:
        ctx.output_dir.mkdir(parents=True, exist_ok=True)
        (ctx.output_dir / "config.json").write_text(json.dumps(ctx.config(), indent=2))


def start_run(stage_args_cls: type, argv: Optional[list[str]] = None, stage: Optional[str] = None) -> RunContext:
    """Parse configs and check them (adapters, model name, memory budget) before anything heavy."""
    model_args, data_args, train_args, stage_args = parse_config(
        (ModelArguments, DataArguments, TrainArguments, stage_args_cls), argv)
    accelerator = make_accelerator(train_args)
    setup_logging(accelerator)
    check_launch(accelerator, stage)
    set_seed(train_args.seed)
    simulate_gpu_memory(train_args.simulate_gpu_gib, accelerator.device)
    check_adapter_paths(stage_args)
    try:
        tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                                   model_args.tokenizer_name_or_path)
        if stage is not None and train_args.check_budget:
            check_budget(stage, model_args, data_args, train_args, stage_args, accelerator.device, accelerator)
        splits, report = load_splits(data_args)
    except (ModelLoadError, DataError) as exc:
        raise SystemExit(f"{type(exc).__name__}: {exc}") from exc
    ctx = RunContext(model_args, data_args, train_args, stage_args, accelerator, tokenizer, splits,
                     resolved={"dataset_fingerprint": report.fingerprint})
    prepare_output_dir(ctx)
    return ctx


def save_final_adapter(ctx: RunContext, model, adapter: str, folder: str = "adapter") -> Optional[Path]:
    """The stage's product in PEFT format, with the base-model settings needed to load it again."""
    ctx.accelerator.wait_for_everyone()
    unwrapped = ctx.accelerator.unwrap_model(model)
    with gathered_trainable(ctx.accelerator, unwrapped):  # ZeRO-3 partitions them: every rank gathers
        if not ctx.accelerator.is_main_process:
            return None
        out = unwrapped.save_adapter(adapter, ctx.output_dir / folder)
    (out / BASE_MODEL_FILE).write_text(json.dumps(asdict(ctx.model_args), indent=2))
    logger.info("saved the %s adapter to %s", adapter, out)
    return out


def base_model_args(adapter_dir: str | Path, **overrides) -> ModelArguments:
    """The ModelArguments an adapter was trained with (from its base_model.json), with overrides."""
    path = Path(adapter_dir) / BASE_MODEL_FILE
    values = json.loads(path.read_text()) if path.is_file() else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelArguments(**values)


def finish_stage(ctx: RunContext, stage: str, model, adapter: str, **facts: Any) -> dict[str, Any]:
    """Save the stage's adapter and write results.json: facts plus the first and last evaluation."""
    path = save_final_adapter(ctx, model, adapter)
    evals = eval_history(ctx.output_dir)
    results = {"stage": stage, "adapter": str(path), **facts,
               "eval_before": evals[0] if evals else None, "eval_after": evals[-1] if evals else None}
    if ctx.accelerator.is_main_process:
        (ctx.output_dir / "results.json").write_text(json.dumps(results, indent=2))
        logger.info("results: %s", json.dumps(results))
    return results


def eval_history(output_dir: Path) -> list[dict[str, Any]]:
    """The evaluation lines of a run's metrics.jsonl, in step order (resumed runs included)."""
    from trainer.loop import METRICS_FILE

    path = output_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in rows if any(k.startswith("eval/") for k in r)]
