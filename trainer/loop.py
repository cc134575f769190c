"""The training loop every stage shares: accumulate, clip, step, evaluate, checkpoint, log.

A stage (SFT, reward, DPO) supplies `compute_loss(model, batch)` and `evaluate(model)`; this module
owns everything around them, so no stage script repeats it. The same loop runs on one device, under
DDP, and under DeepSpeed, where the engine clips and steps inside the last backward of a step
(see `run_training`).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainArguments
from trainer.launch import (
    RowTrace, accelerator_kwargs, describe_engine, fill_deepspeed_autos, fix_deepspeed_cpu_ranks, is_deepspeed,
)
from trainer.optim import build_loop_optimizer, schedule_for

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class TrainingDiverged(RuntimeError):
    """Too many optimizer steps in a row had a NaN or inf loss or gradient."""


@dataclass
class StepOutput:
    """What a stage returns for one micro-batch."""

    loss: torch.Tensor  # scalar to backpropagate (a mean over this micro-batch)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars, averaged per step
    tokens: int = 0  # tokens processed, for tokens/s


class Stage(Protocol):
    name: str
    trainable_adapters: list[str]

    def compute_loss(self, model, batch: dict[str, torch.Tensor]) -> StepOutput: ...

    def evaluate(self, model, accelerator) -> dict[str, float]: ...


class EpochShuffleSampler(Sampler[int]):
    """A fresh permutation each epoch from (seed, epoch) alone, so a resumed run sees the same order."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=g).tolist())

    def __len__(self) -> int:
        return self.size


def resolve_mixed_precision(name: str) -> str:
    if name not in ("auto", "no", "bf16", "fp16"):
        raise ValueError(f"unknown mixed_precision '{name}': use auto, no, bf16 or fp16")
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


def make_accelerator(args: TrainArguments):
    """The Accelerator for a stage: accumulation, precision, trackers. Create it before the model."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise warn on every import
    out = Path(args.output_dir)
    accelerator = Accelerator(
        **accelerator_kwargs(),
        mixed_precision=resolve_mixed_precision(args.mixed_precision),
        # Steps are counted in micro-batches, never cut short at an epoch boundary.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        log_with="tensorboard" if args.report_to == "tensorboard" else None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tensorboard")),
    )
    fix_deepspeed_cpu_ranks(accelerator)
    return accelerator


def finish_trackers(accelerator) -> None:
    """`end_training` without its destroy_process_group: the stage still saves its adapter after the loop."""
    for tracker in accelerator.trackers:
        tracker.finish()


def setup_logging(accelerator, stream=None) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=stream or sys.stdout, force=True)
    # peft still reads transformers' deprecated `is_gradient_checkpointing`; nothing for a user to act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    for noisy in ("httpx", "urllib3", "filelock", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def peak_memory_gb(device: torch.device) -> tuple[float, str]:
    """Peak device memory in GB (CUDA allocator) or, on CPU, the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "gpu"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "rss"


def make_loader(dataset: Dataset, collate_fn: Callable, batch_size: int, seed: int) -> tuple[DataLoader, EpochShuffleSampler]:
    if len(dataset) < batch_size:
        raise ValueError(f"the training set has {len(dataset)} rows, fewer than one micro-batch ({batch_size})")
    sampler = EpochShuffleSampler(len(dataset), seed)
    # Its own generator: creating a DataLoader iterator draws a seed, and drawing it from the global
    # RNG would shift every later dropout mask whenever a resumed run creates one more iterator.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def batch_stream(accelerator, loader, sampler: EpochShuffleSampler, epoch: int, skip: int):
    """Yield (epoch, batches done in this epoch, batch) forever, starting `skip` batches into `epoch`."""
    while True:
        source = accelerator.skip_first_batches(loader, skip) if skip else loader
        # Accelerate's prepared loaders count their own passes and reset the sampler's epoch to that
        # count when iterated; a resumed run's first pass (and the skipping loader, which starts at
        # pass 0) would replay epoch 0's order. Setting the epoch on the loader itself keeps them aligned.
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)
        sampler.set_epoch(epoch)
        done = skip
        for batch in source:
            done += 1
            yield epoch, done, batch
        epoch, skip = epoch + 1, 0


def all_finite(accelerator, value: torch.Tensor) -> bool:
    """True when `value` is finite on every rank (ranks must agree, or DDP would hang)."""
    flag = torch.tensor(1.0 if bool(torch.isfinite(value.detach()).all()) else 0.0, device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


class MetricsLog:
    """One JSON line per logged step in the run folder, plus TensorBoard through Accelerate."""

    def __init__(self, accelerator, output_dir: Path):
        self.accelerator = accelerator
        self.path = output_dir / METRICS_FILE

    def truncate_after(self, step: int) -> None:
        """Drop lines a killed run wrote after the checkpoint it resumes from."""
        if not self.accelerator.is_main_process or not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.accelerator.log(metrics, step=step)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")


def _format(metrics: dict[str, float], keys: list[str]) -> str:
    parts = []
    for key in keys:
        if key in metrics:
            value = metrics[key]
            parts.append(f"{key.split('/')[-1]} {value:.4g}")
    return " | ".join(parts)


def make_recorder(stage_name: str, model, optimizer, args: TrainArguments, accelerator):
    """The memory recorder of a run (a no-op unless `profile_memory`; main process only)."""
    from profiling.components import GIB
    from profiling.recorder import MemoryRecorder

    return MemoryRecorder(stage_name, model=model, optimizer=optimizer, device=accelerator.device,
                          budget_bytes=int(args.memory_budget_gib * GIB),
                          enabled=args.profile_memory and accelerator.is_main_process)


def run_training(stage: Stage, model, train_dataset: Dataset, collate_fn: Callable, args: TrainArguments,
                 accelerator, config: Optional[dict[str, Any]] = None, resume_from: Optional[Path] = None,
                 extra_state: Optional[Callable[[], dict]] = None) -> dict[str, float]:
    """Train `model` with `stage` for `args.max_steps` optimizer steps, continuing the verified checkpoint
    `resume_from` if given (see `trainer.run.prepare_output_dir`); returns the last evaluation."""
    from tqdm.auto import tqdm

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    unwrapped = model
    optimizer = build_loop_optimizer(unwrapped.trainable_parameters(), args, accelerator)
    loader, sampler = make_loader(train_dataset, collate_fn, args.micro_batch_size, args.seed)
    fill_deepspeed_autos(accelerator, unwrapped, args.max_grad_norm)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = schedule_for(model, optimizer, args)
    deepspeed = is_deepspeed(accelerator)
    if deepspeed and accelerator.is_main_process:
        logger.info(describe_engine(model))
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP swaps in sharded ones in prepare
    recorder = make_recorder(stage.name, unwrapped, optimizer, args, accelerator)
    trace = RowTrace(accelerator)

    state = {"epoch": 0, "batches_in_epoch": 0, "bad_steps_in_row": 0, "bad_steps_total": 0}
    metrics_log = MetricsLog(accelerator, output_dir)
    start_step = 0
    if resume_from is not None:
        state.update(load_checkpoint(accelerator, resume_from, model, stage.trainable_adapters, optimizer, scheduler))
        start_step = state.pop("step")
        metrics_log.truncate_after(start_step)
    elif accelerator.is_main_process and metrics_log.path.exists():
        metrics_log.path.unlink()  # a fresh run in a used folder starts a fresh log
    if args.report_to == "tensorboard":
        accelerator.init_trackers(stage.name, config=flat_config(config or {}))

    last_eval: dict[str, float] = {}
    if start_step == 0:
        with recorder.phase("evaluate"):
            last_eval = _evaluate(stage, model, accelerator, metrics_log, 0)
    stream = batch_stream(accelerator, loader, sampler, state["epoch"], state["batches_in_epoch"])
    bar = tqdm(total=args.max_steps, initial=start_step, desc=stage.name, dynamic_ncols=True,
               disable=not (accelerator.is_main_process and args.progress_bar))
    model.train()
    for step in range(start_step + 1, args.max_steps + 1):
        started = time.perf_counter()
        sums: dict[str, float] = defaultdict(float)
        tokens, finite = 0, True
        lr = scheduler.get_last_lr()[0]
        with recorder.phase("forward_backward", count_saved=step == start_step + 1):
            for _ in range(args.gradient_accumulation_steps):
                state["epoch"], state["batches_in_epoch"], batch = next(stream)
                trace.record(step, batch)
                with accelerator.accumulate(model), accelerator.autocast():
                    out = stage.compute_loss(model, batch)
                    loss_finite = all_finite(accelerator, out.loss)
                    finite = finite and loss_finite
                    # DeepSpeed counts micro-steps itself and steps inside the last backward: it gets
                    # every loss, and a NaN one makes NaN gradients that its overflow check skips.
                    if loss_finite or deepspeed:
                        accelerator.backward(out.loss)
                tokens += out.tokens
                for key, value in out.metrics.items():
                    sums[key] += float(value) / args.gradient_accumulation_steps
            recorder.sample()  # gradients are alive here
        if deepspeed:
            # The engine clipped to max_grad_norm and stepped, or skipped the step (non-finite gradients).
            stepped, grad_norm = model.was_step_applied(), model.get_global_grad_norm()
            grad_norm = torch.tensor(float("nan") if grad_norm is None else float(grad_norm))
            # fp16 loss scaling skips steps by design while it calibrates: not a bad step.
            finite = stepped or (finite and model.fp16_enabled())
        else:
            grad_norm = torch.tensor(float("nan"))
            if finite:
                max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                grad_norm = accelerator.clip_grad_norm_(params, max_norm)
                finite = all_finite(accelerator, grad_norm)
            stepped = finite
            if stepped:
                with recorder.phase("optimizer_step"):
                    optimizer.step()
        if stepped:
            scheduler.step()
        if finite:
            state["bad_steps_in_row"] = 0
        else:
            state["bad_steps_in_row"] += 1
            state["bad_steps_total"] += 1
            logger.warning("step %d: non-finite loss or gradient, step skipped (%d in a row, %d in all)",
                           step, state["bad_steps_in_row"], state["bad_steps_total"])
        optimizer.zero_grad(set_to_none=True)
        if state["bad_steps_in_row"] >= args.max_bad_steps:
            finish_trackers(accelerator)
            raise TrainingDiverged(
                f"{state['bad_steps_in_row']} steps in a row had a NaN/inf loss or gradient (at step {step}); "
                "lower the learning rate, check the data, or raise max_bad_steps")

        elapsed = time.perf_counter() - started
        metrics = _reduce(accelerator, {f"train/{k}": v for k, v in sums.items()})
        total_tokens = accelerator.reduce(torch.tensor(float(tokens), device=accelerator.device), "sum").item()
        peak, kind = peak_memory_gb(accelerator.device)
        metrics.update({"train/lr": lr, "train/grad_norm": float(grad_norm), "perf/tokens_per_s": total_tokens / elapsed,
                        "perf/step_s": elapsed, f"perf/peak_{kind}_gb": peak,
                        "train/skipped_steps": float(state["bad_steps_total"])})
        if step % args.log_every == 0 or step == args.max_steps:
            metrics_log.write(step, metrics)
            if accelerator.is_main_process:
                bar.write(f"step {step}/{args.max_steps} | " + _format(metrics, [
                    "train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", f"perf/peak_{kind}_gb"]))
        bar.update(1)
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            with recorder.phase("evaluate"):
                last_eval = _evaluate(stage, model, accelerator, metrics_log, step)
            model.train()
        if args.save_every and (step % args.save_every == 0 or step == args.max_steps):
            extras = extra_state() if extra_state else {}
            save_checkpoint(accelerator, output_dir, step, model, stage.trainable_adapters, optimizer, scheduler,
                            {**state, **extras}, args.keep_checkpoints, config)
    bar.close()
    recorder.write(output_dir, config=flat_config(config or {}))
    finish_trackers(accelerator)
    return last_eval


def _evaluate(stage: Stage, model, accelerator, metrics_log: MetricsLog, step: int) -> dict[str, float]:
    model.eval()
    with torch.no_grad(), accelerator.autocast():
        results = stage.evaluate(model, accelerator)
    metrics = {f"eval/{k}": float(v) for k, v in results.items()}
    metrics_log.write(step, metrics)
    if accelerator.is_main_process:
        logger.info("eval at step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return metrics


def _reduce(accelerator, values: dict[str, float]) -> dict[str, float]:
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], device=accelerator.device, dtype=torch.float64)
    t = accelerator.reduce(t, reduction="mean")
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """TensorBoard's hparams take scalars and strings only."""
    flat = {}
    for key, value in config.items():
        if hasattr(value, "__dataclass_fields__"):
            value = asdict(value)
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in flat.items()}
