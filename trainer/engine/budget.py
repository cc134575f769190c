"""Check a stage's predicted peak memory against the budget before loading anything.

The analytic estimator (`profiling.predict`) is handed the stage's own argument objects; if the peak
does not fit `memory_budget_gib`, the run stops at once with the estimator's suggestions instead of
running out of memory an hour in.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from foundation.cli import UsageError, given
from profiling import components as C
from profiling import resolve
from profiling.advice import advice_lines
from profiling.device import cuda_context_bytes, warm_up
from profiling.plan import PLANNABLE, auto_fit_on, plan_rl, what_does_not_fit
from profiling.predict import EstimateArguments, estimate, resolve_shape
from trainer.engine.launch import deepspeed_config, offloads_optimizer, shards_parameters
from trainer.engine.memory_options import MemoryOptions

logger = logging.getLogger(__name__)


class BudgetError(UsageError):
    """The stage's estimated peak memory exceeds the configured budget."""


def estimate_arguments(stage: str, model_args, data_args, train_args, stage_args, accelerator) -> EstimateArguments:
    """The stage's settings as the estimator reads them (the same field names), on this run's device.

    Facts only the launch knows are added: the device, the CUDA context it holds (measured), and DeepSpeed's
    optimizer offload (the optimizer states then live in host RAM). Precision and 'auto' settings resolve by the same rule
    the model loading uses (`profiling.resolve`).
    """
    device = accelerator.device.type
    extra = {"stage": stage, "device": "cuda" if device == "cuda" else "cpu"}
    if device == "cuda":
        extra["cuda_context_gib"], _ = start_context_gib(accelerator.device)
    if offloads_optimizer(deepspeed_config(accelerator)):
        extra["optimizer"] = "deepspeed_zero2_offload"
    return EstimateArguments.of_run(model_args, data_args, train_args, stage_args, **extra)


@functools.cache
def cuda_context_gib(device) -> Optional[float]:
    """The CUDA context this process holds on `device`, measured once at start (`profiling.device`); None,
    said in one line, where NVML cannot read it: the estimate then assumes EstimateArguments' default."""
    warm_up(device)
    measured, why = cuda_context_bytes(device)
    if measured is None:
        logger.info("cuda_context: %s; the estimate assumes %s GiB", why, EstimateArguments().cuda_context_gib)
        return None
    logger.info("cuda_context: %s GiB measured on %s (NVML for this process, less the allocator's)",
                C.gib(measured), device)
    return measured / C.GIB


def outside_allocator_gib(device) -> tuple[float, str]:
    """(GiB a run on the CUDA `device` holds outside PyTorch's allocator over its course, the words saying what
    it is): the context the estimate counts (`start_context_gib`) and the kernels CUDA loads as the run first
    calls them (assumed: `EstimateArguments.cuda_kernels_gib`)."""
    (start, measured), kernels = start_context_gib(device), EstimateArguments().cuda_kernels_gib
    said = f"{start:.2f} GiB measured at start" if measured else f"{start:g} GiB assumed"
    return start + kernels, f"the CUDA context ({said}) and the kernels loaded as first called ({kernels:g} GiB)"


def start_context_gib(device) -> tuple[float, bool]:
    """(GiB of CUDA context every estimate on the CUDA `device` counts, whether it was measured): the figure
    measured at start, else EstimateArguments' assumed default."""
    measured = cuda_context_gib(device)
    return (EstimateArguments().cuda_context_gib, False) if measured is None else (measured, True)


def context_at_start(device) -> Optional[int]:
    """Bytes of the CUDA context this process measured at its start (what its estimate used); None off CUDA
    or where NVML cannot read it."""
    if device.type != "cuda":
        return None
    measured = cuda_context_gib(device)
    return None if measured is None else int(measured * C.GIB)


def check_budget(stage: str, model_args, data_args, train_args, stage_args, accelerator) -> dict:
    """Return the estimate; raise BudgetError naming what to change when it does not fit."""
    args = estimate_arguments(stage, model_args, data_args, train_args, stage_args, accelerator)
    shape = resolve_shape(args)
    est = estimate(shape, args)
    peak, budget = est["peak_bytes"], args.budget_bytes
    if est["fits"]:
        logger.info("memory estimate: peak %s GiB (%s) within the %s GiB budget", C.gib(peak), est["peak_phase"],
                    C.gib(budget))
        return est
    raise BudgetError(
        f"{stage}: the estimated peak memory {C.gib(peak)} GiB (phase '{est['peak_phase']}') exceeds "
        f"memory_budget_gib={train_args.memory_budget_gib}. Change the settings, or raise the budget "
        f"(check_budget: false skips this check): {_advice(shape, args, est)}")


def _advice(shape, args: EstimateArguments, est: dict) -> str:
    """The estimator's changes that would fit (`profiling.advice`), on one line."""
    lines, _ = advice_lines(shape, args.resolved(), est)
    return " ".join(line.strip() for line in lines)


def fit_to_budget(stage: str, model_args, data_args, train_args, stage_args, accelerator,
                  plannable: frozenset[str] = frozenset(PLANNABLE)):
    """An online RL stage's budget plan (`profiling.plan`) applied to the run's settings, when `auto_fit`
    is on (its default on CUDA): returns (model_args, train_args, stage_args) with the settings of
    `plannable` left auto (not given on the command line or in the config: `foundation.cli.given`) as the
    plan chose them; `generation_weights` and `decode` auto become the plan's picks (unplanned, the weights as
    they are and `MemoryOptions.decode_path`'s rule). Where nothing fits with the settings given, BudgetError
    names the given one that does not (with `check_budget` off, the run keeps its settings, warned)."""
    from dataclasses import replace

    if not auto_fit_on(stage_args.auto_fit, accelerator.device.type):  # nothing planned (see the docstring)
        return model_args, train_args, stage_args
    args = estimate_arguments(stage, model_args, data_args, train_args, stage_args, accelerator)
    may_offload = MemoryOptions.of(model_args, stage_args).may_offload(accelerator)
    if shards_parameters(accelerator):  # no compiled decode step to plan for (`MemoryOptions.decode_path`)
        args = replace(args, decode=resolve.decode_path(args.decode, "cuda", sharded=True))
    planned = set(plannable) - given(model_args) - given(train_args) - given(stage_args)
    shape = resolve_shape(args)
    plan = plan_rl(shape, args, stage_args.mini_batch_size, may_offload=may_offload, planned=planned)
    if plan is None and train_args.check_budget:
        what, phase, least, est = what_does_not_fit(shape, args, may_offload=may_offload, planned=planned)
        totals = {p["phase"]: p["total"] for p in est["phases"]}
        raise BudgetError(
            f"{stage}: {what} needs an estimated {C.gib(totals[phase])} GiB in phase '{phase}', over "
            f"memory_budget_gib={train_args.memory_budget_gib} whatever the settings left auto. Change the settings "
            f"given, or raise the budget (check_budget: false skips this check): {_advice(shape, least, est)}")
    if plan is None:
        logger.warning("auto_fit: nothing fits memory_budget_gib=%s with the settings given; keeping the "
                       "configured ones", train_args.memory_budget_gib)
        return model_args, train_args, stage_args
    logger.info("%s", plan.table())
    return (replace(model_args, gradient_checkpointing=plan.gradient_checkpointing,
                    offload_embeddings=plan.offload_embeddings, offload_activations=plan.offload_activations),
            replace(train_args, micro_batch_size=plan.micro_batch_size),
            replace(stage_args, rollout_micro_batch_size=plan.rollout_micro_batch_size, decode=plan.decode,
                    generation_weights=plan.generation_weights if stage_args.generation_weights == "auto"
                    else stage_args.generation_weights))
