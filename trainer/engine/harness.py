"""The one harness every stage runs in, and the pieces of a training step the stages share.

`Engine`: a model made ready to train in the launch mode at hand (optimizer, LR schedule, Accelerate /
DeepSpeed wrappers, memory recorder) and `optimizer_step()` (clip, NaN check, step, parameter check).
`Harness` runs an engine for `max_steps` around a stage's step body (step number, batch stream ->
`StepResult`): resume, progress, metrics, evaluation and checkpoint cadence, and the NaN/inf policy (a
non-finite step is skipped, `max_bad_steps` in a row stop the run, a non-finite weight stops it at once).
Step bodies: `supervised_step(engine, compute_loss)` for SFT, reward and DPO; `trainer.rl.online.rl_step` for
PPO, GRPO and RLOO.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

import torch

from foundation.cli import InputError, first_line
from foundation.files import reported_write_failure
from foundation.settings import ONLINE_RL_STAGES
from profiling.device import peak_bytes
from profiling.plan import auto_fit_on
from trainer.engine.batches import batch_stream, make_loader
from trainer.engine.budget import context_at_start
from trainer.engine.checkpoint import load_checkpoint, save_checkpoint
from trainer.engine.launch import describe_engine, fill_deepspeed_autos, is_deepspeed
from trainer.engine.metrics import (
    MetricsLog, all_finite, flat_config, format_line, largest_weight, mean_over_ranks, unusable_weights,
)
from trainer.engine.optim import build_loop_optimizer, schedule_for
from trainer.engine.phases import phase, raised_in, watching

logger = logging.getLogger(__name__)


class TrainingDiverged(InputError):
    """Too many optimizer steps in a row had a NaN or inf loss or gradient, or a step made a parameter NaN/inf."""


class OutOfMemory(InputError, torch.OutOfMemoryError):
    """The device ran out of memory during a run: one line (step, phase, what to change); still an OOM error to
    whoever catches those (a benchmark's side)."""


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


@dataclass
class StepOutput:
    """What a stage's `compute_loss` returns for one micro-batch."""

    loss: torch.Tensor  # scalar to backpropagate: this micro-batch's share of the step's mean (step_mean_share)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars, averaged per step
    tokens: int = 0  # tokens processed, for tokens/s


@dataclass
class StepResult:
    """What one step body did: its figures (this rank's), whether its losses and gradients were all finite
    (`finite`; a step that was not counts towards max_bad_steps), and whether the weights moved (`stepped`;
    the learning-rate schedule advances only then)."""

    metrics: dict[str, float]
    finite: bool = True
    stepped: bool = True
    tokens: int = 0


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Engine:
    """A model ready to train: optimizer, schedule and wrappers for the launch mode, and its memory recorder.

    `model` is what `accelerator.prepare` returned (DDP / DeepSpeed wrap it: training passes go through
    it); `raw` is the model itself (generation and no-grad scoring go around the wrapper).
    """

    def __init__(self, model, train_args, accelerator, stage: str, loader=None, accumulation_steps: Optional[int] = None,
                 optimizer: Optional[str] = None):
        from profiling.components import GIB
        from profiling.recorder import MemoryRecorder

        self.args, self.accelerator, self.raw = train_args, accelerator, model
        if accumulation_steps is not None and is_deepspeed(accelerator):
            accelerator.gradient_accumulation_steps = accumulation_steps  # the engine fixes it at prepare
        optimizer = build_loop_optimizer(model.trainable_parameters(), train_args, accelerator, optimizer)
        fill_deepspeed_autos(accelerator, model, train_args.max_grad_norm)
        if loader is None:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            self.loader = None
        else:
            self.model, self.optimizer, self.loader = accelerator.prepare(model, optimizer, loader)
        self.scheduler = schedule_for(self.model, self.optimizer, train_args)
        self.deepspeed = is_deepspeed(accelerator)
        if self.deepspeed and accelerator.is_main_process:
            logger.info(describe_engine(self.model))
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # FSDP swaps in sharded ones
        self.recorder = MemoryRecorder(stage, model=model, optimizer=self.optimizer, device=accelerator.device,
                                       budget_bytes=int(train_args.memory_budget_gib * GIB),
                                       enabled=train_args.profile_memory and accelerator.is_main_process,
                                       context_at_start=context_at_start(accelerator.device))

    @contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradient accumulation, mixed precision and, with
        --offload_activations, the saved activations in host memory."""
        with self.accelerator.accumulate(self.model), self.accelerator.autocast(), self.raw.training_pass():
            yield

    def loss_divisor(self, accumulation_steps: int) -> int:
        """What a backward's gradient ends up divided by: Accelerate's (or DeepSpeed's, fixed at prepare) division
        by the accumulation steps, times the ranks' gradient average."""
        steps = self.model.gradient_accumulation_steps() if self.deepspeed else accumulation_steps
        return steps * self.accelerator.num_processes

    def step_units(self, local_units: float) -> float:
        """The units (tokens, pairs, rows) an optimizer step's loss is a mean over, summed over the ranks (>= 1)."""
        acc = self.accelerator
        total = float(local_units)
        if acc.num_processes > 1:
            total = float(acc.reduce(torch.tensor(total, dtype=torch.float64, device=acc.device), reduction="sum"))
        return max(total, 1.0)

    def backward(self, loss: torch.Tensor) -> bool:
        """Backpropagate `loss` if it is finite on every rank; returns whether it was.

        Under DeepSpeed every loss goes through: the engine counts micro-steps itself and steps inside the
        last backward, and a NaN loss makes NaN gradients that its overflow check skips.
        """
        finite = all_finite(self.accelerator, loss)
        if finite or self.deepspeed:
            self.accelerator.backward(loss)
        return finite

    def optimizer_step(self, finite: bool = True) -> tuple[bool, bool, float]:
        """Clip and step after the backward passes of one optimizer step: (stepped, sound, gradient norm).

        Nothing steps when a loss (`finite=False`) or the gradient is not finite on some rank; `sound` is
        False then. fp16 loss scaling skips steps by design while it calibrates its scale: that is sound,
        just not stepped (its scaler must see every step, or the scale never comes down). Under DeepSpeed
        the engine has clipped and stepped (or skipped the step) already; this reads what it did.
        """
        if self.deepspeed:
            stepped, norm = self.model.was_step_applied(), self.model.get_global_grad_norm()
            sound = finite and (stepped or self.model.fp16_enabled())
            self.optimizer.zero_grad(set_to_none=True)
            if stepped:
                self.check_parameters()
            return stepped, sound, float("nan") if norm is None else float(norm)
        norm = torch.tensor(float("nan"))
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            return False, False, float(norm)
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        norm = self.accelerator.clip_grad_norm_(self.params, max_norm)
        norm_finite = all_finite(self.accelerator, norm)
        scaled = self.accelerator.scaler is not None  # fp16 AMP: the scaler decides, and must update
        if norm_finite or scaled:
            with phase("optimizer_step"):
                self.optimizer.step()
        stepped = norm_finite and not (scaled and self.optimizer.step_was_skipped)
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self.check_parameters()
        return stepped, norm_finite or scaled, float(norm)

    def check_parameters(self) -> None:
        """Stop when the step just taken left a trainable weight NaN, inf or so large that every forward overflows
        (an absurd learning rate or weight decay with finite gradients): unlike a bad gradient it cannot be
        skipped, the weights are lost. One host sync."""
        problem = unusable_weights(largest_weight(self.accelerator, self.params))
        if problem:
            raise TrainingDiverged(f"the optimizer step left {problem}, with --learning_rate "
                                   f"{self.args.learning_rate:g} and --weight_decay {self.args.weight_decay:g}; lower "
                                   "them (these weights are not saved)")


StepBody = Callable[[int, Iterator[dict]], StepResult]


class Harness:
    """Runs `engine` for train_args.max_steps optimizer steps around a stage's step body (see the module doc)."""

    def __init__(self, ctx, model, stage: str, adapters: list[str], dataset, collate: Callable,
                 evaluate: Callable[["Engine"], dict[str, float]], log_keys: list[str], extra_state: Optional[Stateful] = None,
                 accumulation_steps: Optional[int] = None, by_length: bool = False, batch_size: Optional[int] = None):
        self.ctx, self.args, self.accelerator = ctx, ctx.train_args, ctx.accelerator
        self.stage, self.adapters, self.evaluate_fn, self.log_keys = stage, adapters, evaluate, log_keys
        self.extra_state = extra_state
        # The window spans every rank's share of a step: N processes with accumulation A group as one with N x A.
        ranks = self.accelerator.num_processes
        batch_size = batch_size or ctx.plan.micro_batch_size  # a training micro-batch, or an RL step's prompts
        # `by_length` (SFT, reward, DPO) with --group_by_length: each optimizer step's rows grouped by length
        window = batch_size * self.args.gradient_accumulation_steps if by_length and self.args.group_by_length else 0
        loader, self.sampler = make_loader(dataset, collate, batch_size, self.args.seed, window * ranks, ranks)
        self.engine = Engine(model, self.args, self.accelerator, stage, loader, accumulation_steps, ctx.plan.optimizer)
        self.output_dir = Path(self.args.output_dir)
        self.metrics_log = MetricsLog(self.accelerator, self.output_dir)
        self.state = {"epoch": 0, "batches_in_epoch": 0, "bad_steps_in_row": 0, "bad_steps_total": 0}
        self.step = 0  # the step being taken (0: the evaluation before the first)

    # ---- the loop ---------------------------------------------------------------------------------
    def train(self, step_body: StepBody) -> dict[str, float]:
        """Run the steps, the memory recorder watching their phases (`trainer.engine.phases`); returns the last
        evaluation."""
        with watching(self.engine.recorder.phase):
            try:
                return self._train(step_body)
            except BaseException as exc:  # out of memory under a card's cap, Ctrl-C: the record says where it stopped
                where = raised_in(exc)
                record = self._write_memory_record(exc, where)
                if is_oom(exc) and not isinstance(exc, InputError):
                    raise OutOfMemory(self._out_of_memory(exc, where, record)) from exc
                if record:
                    logger.info("the phases recorded until the run stopped: %s", record)
                raise

    def _write_memory_record(self, exc: BaseException, where: Optional[str]) -> Optional[Path]:
        """memory.json and its report with the phases recorded so far and where the run stopped: memory.md's path
        (None: not recording, or not written)."""
        recorder = self.engine.recorder
        recorder.stopped(self.step, where, exc)
        try:
            written = recorder.write(self.output_dir, config=flat_config(self.ctx.config()))
        except Exception as failure:  # the error that stopped the run is the one to raise
            logger.warning("the memory record of the stopped run was not written: %s", failure)
            return None
        return written.get("md")

    def _out_of_memory(self, exc: Exception, where: Optional[str], record: Optional[Path]) -> str:
        """The one line of a run out of memory: where, what to change, where the phases were recorded (logged on
        a rank other than the first, whose lines the command line does not print)."""
        online = self.stage in ONLINE_RL_STAGES
        if where == "evaluate" and not online:
            lower = "--eval_batch_size"
        elif online:
            lower = "--micro_batch_size, --rollout_micro_batch_size" + (
                " or --generation_weights quantized" if where == "generate" else "")
        else:
            lower = "--micro_batch_size"
        planned = online and auto_fit_on(getattr(self.ctx.stage_args, "auto_fit", None),
                                         self.accelerator.device.type)
        holds = " and plan" if planned else ""
        budget = (f"set --memory_budget_gib (now {self.args.memory_budget_gib:g}) to what the card leaves free, "
                  f"which the start-up check{holds} then hold{'' if planned else 's'} the run to, or lower "
                  if self.args.check_budget else "lower ")
        seen = (f"; the phases recorded until then: {record}" if record else
                "" if self.args.profile_memory else "; --profile_memory true records each phase")
        line = (f"out of memory at step {self.step}{f', in phase {where}' if where else ''} ({first_line(exc, 200)}): "
                f"{budget}{lower}{seen}")
        if not self.accelerator.is_main_process:
            logger.error("rank %d: %s", self.accelerator.process_index, line)
        return line

    def _train(self, step_body: StepBody) -> dict[str, float]:
        from tqdm.auto import tqdm

        args, acc, engine = self.args, self.accelerator, self.engine
        start = self._resume()
        self.step = start  # an error before the first step taken here is at the step the run resumed from
        if acc.log_with:  # the trackers make_accelerator checked; wandb's files go into the run folder too
            with reported_write_failure(f"the trackers' files in {self.output_dir}", self.output_dir):
                acc.init_trackers(self.stage, config=flat_config(self.ctx.config()),
                                  init_kwargs={"wandb": {"dir": str(self.ctx.output_dir)}})
        last_eval = self._evaluate(0) if start == 0 else {}
        stream = batch_stream(acc, engine.loader, self.sampler, self.state["epoch"], self.state["batches_in_epoch"])
        bar = tqdm(total=args.max_steps, initial=start, desc=self.stage, dynamic_ncols=True,
                   disable=not (acc.is_main_process and args.progress_bar))
        engine.model.train()
        for step in range(start + 1, args.max_steps + 1):
            self.step = step
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                result = step_body(step, self._batches(step, stream))
            except TrainingDiverged as exc:
                self._finish_trackers()
                raise TrainingDiverged(f"step {step}: {exc}") from None
            elapsed, cpu_elapsed = time.perf_counter() - started, time.process_time() - cpu_started
            self._count_bad_step(step, result.finite)
            if result.stepped:
                engine.scheduler.step()
            self._log(step, result, elapsed, cpu_elapsed, bar)
            bar.update(1)
            if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
                last_eval = self._evaluate(step)
                engine.model.train()
            if args.save_every and (step % args.save_every == 0 or step == args.max_steps):
                extra = self.extra_state.state_dict() if self.extra_state is not None else {}
                save_checkpoint(acc, self.output_dir, step, engine.model, self.adapters, engine.optimizer,
                                engine.scheduler, {**self.state, **extra}, args.keep_checkpoints,
                                self.ctx.config())
        bar.close()
        with reported_write_failure(f"the memory record in {self.output_dir}", self.output_dir):
            engine.recorder.write(self.output_dir, config=flat_config(self.ctx.config()))
        self._finish_trackers()
        return last_eval

    def _batches(self, step: int, stream) -> Iterator[dict]:
        """The batch stream as a step body sees it: the data position is kept for checkpoints."""
        while True:
            self.state["epoch"], self.state["batches_in_epoch"], batch = next(stream)
            yield batch

    def _resume(self) -> int:
        if self.ctx.resume_from is None:
            self.metrics_log.start_fresh()  # a fresh run in a used folder starts a fresh log
            return 0
        engine = self.engine
        state = load_checkpoint(self.accelerator, self.ctx.resume_from, engine.model, self.adapters, engine.optimizer,
                                engine.scheduler)
        step = state.pop("step")
        for key in self.state:
            self.state[key] = state.pop(key, self.state[key])
        if self.extra_state is not None:
            self.extra_state.load_state_dict(state)
        self.metrics_log.truncate_after(step)
        return step

    def _count_bad_step(self, step: int, finite: bool) -> None:
        if finite:
            self.state["bad_steps_in_row"] = 0
            return
        self.state["bad_steps_in_row"] += 1
        self.state["bad_steps_total"] += 1
        logger.warning("step %d: non-finite loss or gradient, step skipped (%d in a row, %d in all)",
                       step, self.state["bad_steps_in_row"], self.state["bad_steps_total"])
        if self.state["bad_steps_in_row"] >= self.args.max_bad_steps:
            self._finish_trackers()
            raise TrainingDiverged(
                f"{self.state['bad_steps_in_row']} steps in a row had a NaN/inf loss or gradient (at step {step}); "
                "lower the learning rate, check the data, or raise max_bad_steps")

    def _log(self, step: int, result: StepResult, elapsed: float, cpu_elapsed: float, bar) -> None:
        acc = self.accelerator
        metrics = mean_over_ranks(acc, result.metrics)
        tokens = acc.reduce(torch.tensor(float(result.tokens), device=acc.device), "sum").item()
        peak, kind = peak_bytes(acc.device)
        peak = max(peak, self.engine.recorder.peak_allocated) / 1e9  # its phases reset CUDA's peak counter
        # step_cpu_s: this process's CPU seconds in the step (all threads): steadier than wall time on a shared CPU
        metrics.update({"perf/step_s": elapsed, "perf/step_cpu_s": cpu_elapsed, f"perf/peak_{kind}_gb": peak,
                        "train/skipped_steps": float(self.state["bad_steps_total"])})
        if result.tokens:
            metrics["perf/tokens_per_s"] = tokens / elapsed
        if step % self.args.log_every == 0 or step == self.args.max_steps:
            self.metrics_log.write(step, metrics)
            if acc.is_main_process:
                keys = [k if k != "perf/peak_gb" else f"perf/peak_{kind}_gb" for k in self.log_keys]
                bar.write(f"step {step}/{self.args.max_steps} | " + format_line(metrics, keys))

    def _evaluate(self, step: int) -> dict[str, float]:
        if not self.ctx.splits.eval:  # --eval_size 0: nothing held out, so no figures (not a loss of 0 over none)
            return {}
        model, acc = self.engine.model, self.accelerator
        model.eval()
        with phase("evaluate"), torch.no_grad(), acc.autocast():
            results = self.evaluate_fn(self.engine)
        metrics = {f"eval/{k}": float(v) for k, v in results.items()}
        if metrics:
            self.metrics_log.write(step, metrics)
            if acc.is_main_process:
                logger.info("eval at step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
        return metrics

    def _finish_trackers(self) -> None:
        """`end_training` without its destroy_process_group: the stage still saves its adapter after the loop."""
        for tracker in self.accelerator.trackers:
            tracker.finish()


def supervised_step(engine: Engine, compute_loss: Callable[[dict, float], StepOutput], accumulation_steps: int,
                    units: Callable[[dict], int]) -> StepBody:
    """The step of SFT, reward and DPO: `accumulation_steps` micro-batches through `compute_loss` (the
    stage's own step body), their gradients summed, then one optimizer step.

    Every unit of a step weighs the same, however its rows are grouped into micro-batches and ranks:
    `units(batch)` counts what the stage's loss is a mean over (completion tokens, pairs), the step's count
    is summed over its micro-batches and ranks before any backward pass, and `compute_loss(batch, normaliser)`
    divides its summed loss by `normaliser` (`step_mean_share`). Logged, "train/loss" is the step's mean."""
    acc = engine.accelerator
    divisor = engine.loss_divisor(acc.gradient_accumulation_steps)  # the normaliser undoes it

    first = [True]  # the first step of this process meters what autograd saves for backward

    def step(step_number: int, batches: Iterator[dict]) -> StepResult:
        sums: dict[str, float] = defaultdict(float)
        tokens, finite, shares = 0, True, 0.0
        lr = engine.scheduler.get_last_lr()[0]
        micro_batches = [next(batches) for _ in range(accumulation_steps)]
        normaliser = engine.step_units(sum(units(batch) for batch in micro_batches)) / divisor
        with phase("forward_backward", count_saved=first[0]):
            for batch in micro_batches:
                with engine.micro_batch():
                    out = compute_loss(batch, normaliser)
                    finite = engine.backward(out.loss) and finite
                tokens += out.tokens
                shares += float(out.loss.detach())
                for key, value in out.metrics.items():
                    sums[f"train/{key}"] += float(value) / accumulation_steps
            engine.recorder.sample()  # gradients are alive here
        first[0] = False
        stepped, sound, grad_norm = engine.optimizer_step(finite)
        # This rank's shares x ranks / `divisor` is its part of the step's mean x ranks: their mean is the step's.
        sums["train/loss"] = shares * acc.num_processes / divisor
        return StepResult({**sums, "train/lr": lr, "train/grad_norm": grad_norm}, finite=sound, stepped=stepped,
                          tokens=tokens)

    return step
