"""Optimizer and learning-rate schedule for the trainable adapters."""

from __future__ import annotations

import copy
import logging
import math
from typing import Optional

import torch

from foundation.cli import UsageError
from profiling import resolve
from trainer.engine.launch import deepspeed_config, is_deepspeed_engine, offloads_optimizer

logger = logging.getLogger(__name__)


def resolve_optimizer_name(name: str, device: torch.device, quiet: bool = False) -> str:
    """What `name` becomes on `device` (profiling.resolve's rule), with a note when a paged request
    runs unpaged (CPU: bitsandbytes pages only CUDA memory)."""
    try:
        resolved = resolve.optimizer(name, device.type, resolve.bitsandbytes_unavailable_reason() is None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if name == "paged_adamw_8bit" and resolved != name and not quiet:
        logger.info("optimizer paged_adamw_8bit -> %s: paging needs CUDA unified memory", resolved)
    return resolved


def build_optimizer(params: list[torch.nn.Parameter], name: str, lr: float, weight_decay: float,
                    device: torch.device, fused: bool = True) -> torch.optim.Optimizer:
    """`name` resolved on `device` over `params` (weight decay on matrices only). `fused`: torch's AdamW
    runs its fused kernel where it can (`fused_adamw`); DeepSpeed's engine, which re-groups the
    parameters into its own partitions, gets the default one."""
    if not params:
        raise UsageError("no trainable parameters: every adapter is frozen")
    name = resolve_optimizer_name(name, device)
    groups = param_groups(params, weight_decay)
    if name == "adamw_torch":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=fused and fused_adamw(params))
        # A checkpoint's param groups carry the kernel choice they were saved with: keep this run's.
        opt.register_load_state_dict_post_hook(_keep_kernel_choice)
    else:
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        opt = cls(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if getattr(opt, "defaults", {}).get("fused"):
        name += " (fused kernel)"
    logger.info("optimizer %s over %s parameters", name, f"{sum(p.numel() for p in params):,}")
    opt.resolved_name = name  # what 'auto' became, for reports
    return opt


def fused_adamw(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's AdamW can run its fused kernel (one kernel over all tensors and no temporary copy
    of the moments, where the default foreach path makes several passes): parameters of one floating dtype
    family on one CPU or CUDA device, none of them a DeepSpeed ZeRO-3 partition. The same update as HF
    Trainer's "adamw_torch_fused"."""
    devices = {p.device for p in params}
    return (len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
            and all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
            and not any(hasattr(p, "ds_id") for p in params))


def _keep_kernel_choice(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on LoRA matrices and head weights only, never on biases."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


# What a DeepSpeed config without an "optimizer" section gets when it offloads the optimizer.
DEEPSPEED_ADAMW = {"type": "AdamW",
                   "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8}}


def build_loop_optimizer(params: list[torch.nn.Parameter], args, accelerator, name: Optional[str] = None):
    """The optimizer to hand `accelerator.prepare`, per launch mode: `name` (a run's plan's), else `args.optimizer`.

    Under DeepSpeed with optimizer offload (or an "optimizer" section in its config) it is a
    placeholder (DummyOptim) from which the engine builds its own optimizer; elsewhere it is ours.
    The LR schedule is built after `prepare` (see `schedule_for`).
    """
    ds_config = deepspeed_config(accelerator)
    if ds_config is not None and (offloads_optimizer(ds_config) or "optimizer" in ds_config):
        return deepspeed_optimizer(params, args, ds_config, accelerator.is_main_process)
    return build_optimizer(params, name or args.optimizer, args.learning_rate, args.weight_decay, accelerator.device,
                           fused=ds_config is None)


def schedule_for(prepared_model, prepared_optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """Our cosine schedule over the optimizer that really steps, in every launch mode.

    The caller steps it once per optimizer step taken. It is never handed to `prepare`: Accelerate's
    wrapper would step it once per process, and with DeepSpeed's optimizer the engine would step it
    once per engine step (PPO schedules per PPO step, not per minibatch). Under DeepSpeed the
    optimizer that steps is the engine's basic optimizer (DeepSpeedCPUAdam with offload).
    """
    target = prepared_model.basic_optimizer if is_deepspeed_engine(prepared_model) else prepared_optimizer.optimizer
    return cosine_with_warmup(target, args.warmup_steps, args.max_steps, args.min_lr_ratio)


def deepspeed_optimizer(params: list[torch.nn.Parameter], args, ds_config: dict, main_process: bool = True):
    """Placeholders for the optimizer the DeepSpeed config names (AdamW added if it offloads and names none).

    DeepSpeed's CPU optimizer offload and a client optimizer (bitsandbytes' 8-bit AdamW) are
    alternatives: the offloaded step runs DeepSpeed's CPU AdamW kernel on fp32 states in host memory.
    An explicit 8-bit request gives way to the launch config, with one line saying so. (Handing
    Accelerate a client optimizer here would make it swap in DeepSpeedCPUAdam silently, as plain
    Adam for a bitsandbytes optimizer.)
    """
    from accelerate.utils import DummyOptim

    if not params:
        raise UsageError("no trainable parameters: every adapter is frozen")
    offload = offloads_optimizer(ds_config)
    if "optimizer" not in ds_config:
        ds_config["optimizer"] = copy.deepcopy(DEEPSPEED_ADAMW)
    kind = ds_config["optimizer"].get("type", "?")
    chosen = f"DeepSpeed {kind}" + (" on the CPU (optimizer offload)" if offload else "")
    if args.optimizer in ("paged_adamw_8bit", "adamw_8bit") and main_process:
        why = ("the DeepSpeed config offloads the optimizer to CPU, and its offloaded step runs only "
               "DeepSpeed's own optimizer" if offload else "the DeepSpeed config names its own optimizer")
        logger.warning("optimizer %s -> %s: %s; for %s launch without DeepSpeed optimizer offload "
                       "(accelerate_configs/single_gpu.yaml or multi_gpu.yaml)", args.optimizer, chosen, why,
                       args.optimizer)
    elif main_process:
        logger.info("optimizer %s over %s parameters", chosen, f"{sum(p.numel() for p in params):,}")
    return DummyOptim(param_groups(params, args.weight_decay), lr=args.learning_rate, weight_decay=args.weight_decay)


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                       min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak, then cosine decay to `min_lr_ratio` of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
