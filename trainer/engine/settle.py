"""Every memory and speed choice of a run, settled once at its start: `settle(...) -> RunPlan`.

    plan = settle(stage, (model_args, data_args, train_args, stage_args), device, Launch.of(accelerator))

In order: what cannot run together or under the launch is refused in one line; quantization, compute dtype and
optimizer `auto` become what they mean on the device (`profiling.resolve`); an online RL stage's budget plan
(`profiling.plan`, with `--auto_fit`, on by default with CUDA) chooses the settings left auto, and its decode path
auto is settled; the peak the plan predicts is checked against the budget; the plan is logged as a table, each
choice marked set or planned. Nothing after it resolves, replaces or re-checks a setting: the model builder, the
harness, the rollouts and the recorder read the plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

from foundation.cli import UsageError
from foundation.run_plan import RunPlan
from foundation.settings import ONLINE_RL_STAGES
from profiling import components as C
from profiling import resolve
from profiling.plan import (
    OFFLOADS, PLANNABLE, auto_fit_on, offload_conflict, offloads_allowed, plan_rl, what_does_not_fit,
)
from profiling.predict import resolve_shape
from trainer.engine.budget import BudgetError, advice, check_budget, estimate_arguments
from trainer.engine.launch import Launch, LaunchError
from trainer.engine.optim import resolve_optimizer_name
from trainer.model.loading import model_plan

logger = logging.getLogger(__name__)


def settle(stage: Optional[str], settings: tuple, device: torch.device, launch: Launch = Launch()) -> RunPlan:
    """The run's plan from its settings (model, data, train, stage arguments) on `device` under `launch`; raises
    LaunchError for a combination that cannot run, BudgetError for a plan that does not fit the budget."""
    model_args, data_args, train_args, stage_args = settings
    check_combinations(model_args, stage_args, launch)
    plan = replace(model_plan(model_args, device, train_args, stage_args),
                   optimizer=resolve_optimizer_name(train_args.optimizer, device))
    # left auto (`RunPlan.of` marks them planned): the planner's to choose, else their unplanned values
    left_auto, budget_plan = set(PLANNABLE) & plan.planned, None
    if stage in ONLINE_RL_STAGES:
        plan, budget_plan = _planned(stage, plan, settings, device, launch, left_auto)
        check_batch_sizes(stage, stage_args, plan.micro_batch_size)
    # auto left unplanned: eager or compiled by the device's rule; the weights as they are
    plan = replace(plan, decode=decode_path(plan.decode, plan.offload_embeddings, device, launch),
                   generation_weights="quantized" if plan.generation_weights == "auto" else plan.generation_weights)
    if stage is not None and train_args.check_budget:
        check_budget(stage, plan, settings, device, launch)
    logger.info("%s", plan.table() + ("\n" + budget_plan.estimate_table() if budget_plan else ""))
    return plan


def check_batch_sizes(stage: str, stage_args, micro_batch_size: int) -> None:
    """An online RL step's rows split into whole minibatches, and each minibatch into whole micro-batches."""
    rows, mini = stage_args.rollout_batch_size, stage_args.mini_batch_size
    what = f"--rollout_batch_size ({rows})"
    if stage == "grpo":
        rows *= stage_args.num_generations
        what = f"rollout_batch_size x num_generations ({rows})"
    if rows % mini or mini % micro_batch_size:
        raise UsageError(f"{what} must be a multiple of --mini_batch_size ({mini}), and that a multiple of "
                         f"--micro_batch_size ({micro_batch_size})")


def check_combinations(model_args, stage_args, launch: Launch) -> None:
    """Refuse, in one line, what the settings asked for cannot run together or under this launch (ZeRO-3 / FSDP
    shard the base): the offloads, compiled layers and the decode path (a stage without rollouts: eager)."""
    decode, compile_layers = getattr(stage_args, "decode", "eager"), model_args.compile_layers
    for name in OFFLOADS:  # the planner's rule (`offload_conflict`), for the offloads set true (not auto)
        why = offload_conflict(name, decode, compile_layers, launch.sharded)
        if getattr(model_args, name) is True and why:
            raise LaunchError(f"--{name} {why}")
    if launch.sharded and compile_layers:
        raise LaunchError(f"--compile_layers is not supported under {launch.sharded}: its module hooks, which gather "
                          "the partitioned weights, would run inside the compiled decoder layers (untested); "
                          "drop --compile_layers")


def decode_path(decode: str, offload_embeddings: bool, device: torch.device, launch: Launch) -> str:
    """--decode as this run decodes (`profiling.resolve.decode_path`: auto is compiled on CUDA), said in one line
    where auto chose."""
    path = resolve.decode_path(decode, device.type, offload_embeddings, bool(launch.sharded))
    if decode == "auto":
        why = ("CUDA: each decode step replayed as CUDA graphs; the first rollout compiles it"
               if path == "compiled" else "eager decoding on " + (
                   "the CPU" if device.type != "cuda" else launch.sharded or "an embedding in host memory"))
        logger.info("decode auto: %s (%s)", path, why)
    return path


def _planned(stage: str, plan: RunPlan, settings: tuple, device: torch.device, launch: Launch, planned: set[str]):
    """(the plan with the budget planner's choices, the planner's plan or None) of an online RL stage: with
    `--auto_fit` on (its default on CUDA) the settings left auto (`planned`) are chosen
    from the estimate; `generation_weights` and `decode` auto become the planner's picks. Where nothing fits with
    the settings given, BudgetError names the given one that does not (with `check_budget` off, the run keeps
    its settings, warned)."""
    _, _, train_args, stage_args = settings
    if not auto_fit_on(stage_args.auto_fit, device.type):
        return plan, None
    args = estimate_arguments(stage, plan, settings, device, launch)
    if launch.sharded:  # no compiled decode step to plan for (`decode_path`)
        args = replace(args, decode=resolve.decode_path(args.decode, "cuda", sharded=True))
    may_offload = offloads_allowed(plan.decode, plan.compile_layers, bool(launch.sharded))
    shape = resolve_shape(args)
    chosen = plan_rl(shape, args, stage_args.mini_batch_size, may_offload=may_offload, planned=planned)
    if chosen is None and train_args.check_budget:
        what, phase, least, est = what_does_not_fit(shape, args, may_offload=may_offload, planned=planned)
        totals = {p["phase"]: p["total"] for p in est["phases"]}
        raise BudgetError(
            f"{stage}: {what} needs an estimated {C.gib(totals[phase])} GiB in phase '{phase}', over "
            f"memory_budget_gib={train_args.memory_budget_gib} whatever the settings left auto. Change the settings "
            f"given, or raise the budget (check_budget: false skips this check): {advice(shape, least, est)}")
    if chosen is None:
        logger.warning("auto_fit: nothing fits memory_budget_gib=%s with the settings given; keeping the "
                       "configured ones", train_args.memory_budget_gib)
        return plan, None
    return replace(plan, **chosen.settings(), planned=plan.planned | chosen.planned), chosen
