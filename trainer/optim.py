"""Optimizer and learning-rate schedule for the trainable adapters."""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

OPTIMIZERS = ("auto", "paged_adamw_8bit", "adamw_8bit", "adamw_torch")


def resolve_optimizer_name(name: str, device: torch.device) -> str:
    """'auto' is bitsandbytes' paged 8-bit AdamW on CUDA and torch AdamW on CPU.

    On CPU bitsandbytes has no paging (it would warn and fall back), so a paged request becomes
    the plain 8-bit AdamW with a one-line note.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{name}': use one of {', '.join(OPTIMIZERS)}")
    if name == "auto":
        return "paged_adamw_8bit" if device.type == "cuda" and _bnb_ok() else "adamw_torch"
    if name == "paged_adamw_8bit" and device.type != "cuda":
        logger.info("optimizer paged_adamw_8bit -> adamw_8bit: paging needs CUDA unified memory")
        return "adamw_8bit"
    if name in ("paged_adamw_8bit", "adamw_8bit") and not _bnb_ok():
        raise ValueError(f"optimizer {name} needs bitsandbytes, which does not import here")
    return name


def _bnb_ok() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def build_optimizer(params: list[torch.nn.Parameter], name: str, lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.Optimizer:
    if not params:
        raise ValueError("no trainable parameters: every adapter is frozen")
    name = resolve_optimizer_name(name, device)
    # Weight decay on LoRA matrices and head weights only, never on biases.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if name == "adamw_torch":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    else:
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        opt = cls(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    logger.info("optimizer %s over %s parameters", name, f"{sum(p.numel() for p in params):,}")
    opt.resolved_name = name  # what 'auto' became, for reports
    return opt


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                       min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak, then cosine decay to `min_lr_ratio` of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
