"""Check a stage's predicted peak memory against the budget before loading anything.

The analytic estimator (`profiling.estimate`) is given the stage's real settings; if the peak does
not fit `memory_budget_gib`, the run stops at once with the estimator's suggestions instead of
running out of memory an hour in.
"""

from __future__ import annotations

import logging

import torch

from trainer.config import DataArguments, ModelArguments, TrainArguments
from trainer.models import resolve_quantization
from trainer.optim import resolve_optimizer_name

logger = logging.getLogger(__name__)


class BudgetError(SystemExit):
    """The stage's estimated peak memory exceeds the configured budget."""


def estimate_arguments(stage: str, model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments,
                       stage_args, device: torch.device, accelerator=None):
    from profiling.estimate import EstimateArguments

    from trainer.launch import deepspeed_config, offloads_optimizer

    four_bit = resolve_quantization(model_args.quantization, device)
    dtype = model_args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" or four_bit else "float32"
    values = dict(
        model=model_args.model_name_or_path, stage=stage, preset_overrides=model_args.preset_overrides,
        quantization="nf4" if four_bit else "none", dtype=dtype, lora_r=model_args.lora_r,
        lora_target_modules=model_args.lora_target_modules, lora_dropout=model_args.lora_dropout,
        # Under a DeepSpeed optimizer-offload launch the states live in host RAM, not on the device.
        optimizer=("deepspeed_zero2_offload" if accelerator is not None and offloads_optimizer(deepspeed_config(accelerator))
                   else resolve_optimizer_name(train_args.optimizer, device, quiet=True)),
        gradient_checkpointing=model_args.gradient_checkpointing, micro_batch=train_args.micro_batch_size,
        max_length=data_args.max_length, device="cuda" if device.type == "cuda" else "cpu",
        budget_gib=train_args.memory_budget_gib,
    )
    if stage == "ppo":
        values.update(prompt_length=data_args.max_prompt_length, generation_length=stage_args.max_new_tokens,
                      rollout_batch=stage_args.rollout_batch_size, generation_batch=stage_args.rollout_micro_batch_size)
    return EstimateArguments(**values)


def check_budget(stage: str, model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments,
                 stage_args, device: torch.device, accelerator=None) -> dict:
    """Return the estimate; raise BudgetError naming what to change when it does not fit."""
    from profiling import components as C
    from profiling.advice import advice_lines
    from profiling.estimate import estimate, resolve_shape

    args = estimate_arguments(stage, model_args, data_args, train_args, stage_args, device, accelerator)
    shape = resolve_shape(args)
    est = estimate(shape, args)
    peak, budget = est["peak_bytes"], args.budget_bytes
    if est["fits"]:
        logger.info("memory estimate: peak %s GiB (%s) within the %s GiB budget", C.gib(peak), est["peak_phase"],
                    C.gib(budget))
        return est
    lines, _ = advice_lines(shape, args, est)
    raise BudgetError(
        f"{stage}: the estimated peak memory {C.gib(peak)} GiB (phase '{est['peak_phase']}') exceeds "
        f"memory_budget_gib={train_args.memory_budget_gib}. Change the settings, or raise the budget "
        "(check_budget: false skips this check):\n" + "\n".join(lines))
