"""The update PPO and GRPO run over one rollout:

    for epoch:                      shuffled rollout rows (`state.minibatch_rng`)
        for minibatch:              one optimizer step each
            for micro-batch:        backward of its loss, weighed by its share of the minibatch's rows or tokens

and around it ONE retry: out of memory, the micro-batch is halved (kept in `state` for the rest of the run)
and the update goes on from the minibatch that ran out; the weights keep every row or token its share.
"""

from __future__ import annotations

import gc
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from foundation.cli import InputError
from trainer.engine.harness import Engine, is_oom

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """What a stage's update runs on its rollout."""

    stage: str  # "PPO" / "GRPO", in messages
    epochs: int  # passes over the rollout
    mini_batch_size: int  # rows per optimizer step
    loss_of: Callable[[torch.Tensor], tuple[torch.Tensor, dict]]  # rows -> (loss: a mean over count_of(rows), stats)
    count_of: Callable[[torch.Tensor], Any]  # rows -> what their loss is a mean over (their tokens, or rows)
    grad_norm_key: str  # the gradient norm's metric name


@dataclass
class UpdateTotals:
    """The update's figures so far; what an out-of-memory retry goes on from."""

    minibatches: int = 0  # minibatches stepped (or skipped for a non-finite gradient)
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    all_finite: bool = True
    any_stepped: bool = False

    def result(self) -> tuple[dict[str, float], bool, bool]:
        """(mean statistics per minibatch, every minibatch finite, any minibatch stepped)."""
        return {k: v / self.minibatches for k, v in self.sums.items()}, self.all_finite, self.any_stepped


def run_update(engine: Engine, state, update: Update, size: int) -> tuple[dict[str, float], bool, bool]:
    """`update.epochs` passes over the `size` rollout rows in shuffled minibatches of one optimizer step each:
    (mean statistics, with the gradient norm as `update.grad_norm_key`; every minibatch finite; any stepped).
    A minibatch whose loss or gradient is not finite is skipped. `state`: the stage's state (`generator`,
    `micro_batch_size`)."""
    orders = [torch.randperm(size, generator=state.minibatch_rng) for _ in range(update.epochs)]
    totals = UpdateTotals()
    while True:
        try:
            _minibatch_steps(engine, state, update, orders, totals)
            return totals.result()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            halve_micro_batch(engine, state, update.stage, exc)


def _minibatch_steps(engine: Engine, state, update: Update, orders: list[torch.Tensor], totals: UpdateTotals) -> None:
    acc = engine.accelerator
    minibatch = 0
    for order in orders:  # epochs
        for rows in order.split(update.mini_batch_size):  # minibatches
            minibatch += 1
            if minibatch <= totals.minibatches:
                continue  # stepped before an out-of-memory retry
            chunks = rows.split(state.micro_batch_size)
            acc.gradient_accumulation_steps = len(chunks)
            acc.step = 0  # realign the accumulation counter (after an OOM retry, too)
            counts = [float(update.count_of(chunk)) for chunk in chunks]
            local = sum(counts)
            # Each micro-batch's loss, a mean over its rows or tokens, weighs its share of the minibatch's count
            # (summed over ranks): every row or token weighs the same whatever the micro-batching. The scale
            # undoes Accelerate's division by the accumulation steps and the ranks' average.
            scale = engine.loss_divisor(len(chunks)) / engine.step_units(local)
            sums: dict[str, float] = defaultdict(float)
            finite = True
            for chunk, count in zip(chunks, counts):  # micro-batches
                with engine.micro_batch():
                    loss, stats = update.loss_of(chunk)
                    finite = engine.backward(loss * (count * scale)) and finite
                for key, value in stats.items():
                    sums[key] += float(value) * count / max(local, 1.0)
            engine.recorder.sample()  # the memory recorder counts gradients while they exist
            stepped, sound, grad_norm = engine.optimizer_step(finite)
            sums[update.grad_norm_key] = grad_norm
            for key, value in sums.items():
                totals.sums[key] += float(value)
            totals.all_finite, totals.any_stepped = totals.all_finite and sound, totals.any_stepped or stepped
            totals.minibatches += 1


def halve_micro_batch(engine: Engine, state, stage: str, exc: BaseException) -> None:
    """After an out-of-memory error `exc` in the update: drop the minibatch's partial gradients and halve
    `state.micro_batch_size`, logged once; re-raise what a retry cannot help."""
    if not is_oom(exc) or state.micro_batch_size == 1:
        raise exc
    if engine.deepspeed or engine.accelerator.num_processes > 1:
        # The engine owns the gradients and fixed its accumulation at prepare time; with
        # several processes a retry on one rank alone would pair its collectives wrongly.
        raise InputError(f"out of memory in the {stage} update at micro-batch {state.micro_batch_size} "
                         "with DeepSpeed or several processes: lower --micro_batch_size (the "
                         "automatic retry needs one process without DeepSpeed)") from None
    engine.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    state.micro_batch_size //= 2
    logger.warning("out of memory in the %s update: retrying the minibatch with micro-batch %d", stage,
                   state.micro_batch_size)
