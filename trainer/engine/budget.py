"""Check a stage's predicted peak memory against the budget before loading anything.

The analytic estimator (`profiling.predict`) is handed the run's plan over its argument objects; if the peak
does not fit `memory_budget_gib`, the run stops at once with the estimator's suggestions instead of
running out of memory an hour in.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Optional

from foundation.cli import UsageError
from profiling import components as C
from profiling.advice import advice_lines
from profiling.device import cuda_context_bytes, warm_up
from profiling.predict import EstimateArguments, estimate, resolve_shape

logger = logging.getLogger(__name__)


class BudgetError(UsageError):
    """The stage's estimated peak memory exceeds the configured budget."""


def estimate_arguments(stage: str, plan, settings: tuple, device, launch) -> EstimateArguments:
    """The stage's settings as the estimator reads them (the same field names), the run's plan (`RunPlan`) over
    its argument objects, on this run's device.

    Facts only the launch knows are added: the device, the CUDA context it holds (measured), and DeepSpeed's
    optimizer offload (the optimizer states then live in host RAM).
    """
    extra = {"stage": stage, "device": "cuda" if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        extra["cuda_context_gib"], _ = start_context_gib(device)
    if launch.optimizer_offload:
        extra["optimizer"] = "deepspeed_zero2_offload"
    return EstimateArguments.of_run(SimpleNamespace(**plan.record()), *settings, **extra)


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


def check_budget(stage: str, plan, settings: tuple, device, launch) -> dict:
    """Return the estimate of the run's plan; raise BudgetError naming what to change when it does not fit."""
    args = estimate_arguments(stage, plan, settings, device, launch)
    shape = resolve_shape(args)
    est = estimate(shape, args)
    peak, budget = est["peak_bytes"], args.budget_bytes
    if est["fits"]:
        logger.info("memory estimate: peak %s GiB (%s) within the %s GiB budget", C.gib(peak), est["peak_phase"],
                    C.gib(budget))
        return est
    raise BudgetError(
        f"{stage}: the estimated peak memory {C.gib(peak)} GiB (phase '{est['peak_phase']}') exceeds "
        f"memory_budget_gib={args.memory_budget_gib}. Change the settings, or raise the budget "
        f"(check_budget: false skips this check): {advice(shape, args, est)}")


def advice(shape, args: EstimateArguments, est: dict) -> str:
    """The estimator's changes that would fit (`profiling.advice`), on one line."""
    lines, _ = advice_lines(shape, args.resolved(), est)
    return " ".join(line.strip() for line in lines)
