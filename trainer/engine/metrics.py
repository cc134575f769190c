"""The run's figures: averaged over ranks, written one JSON line a step to metrics.jsonl and to the
trackers (TensorBoard), and printed as one short line."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """One JSON line per logged step in the run folder, plus TensorBoard through Accelerate."""

    def __init__(self, accelerator, output_dir: Path):
        self.accelerator = accelerator
        self.path = Path(output_dir) / METRICS_FILE

    def truncate_after(self, step: int) -> None:
        """Drop lines a killed run wrote after the checkpoint it resumes from."""
        if not self.accelerator.is_main_process or not self.path.is_file():
            return
        kept = [json.dumps(row) for row in parse_lines(self.path) if row["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def start_fresh(self) -> None:
        if self.accelerator.is_main_process and self.path.exists():
            self.path.unlink()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.accelerator.log(metrics, step=step)
        if self.accelerator.is_main_process:
            from foundation.files import reported_write_failure

            with reported_write_failure(str(self.path), self.path.parent), open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    return parse_lines(path) if path.is_file() else []


def parse_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a metrics file; a line a killed run left half-written is dropped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # half-written, an int past 4300 digits, or nested past the stack
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def eval_history(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluation lines of a run's metrics.jsonl, in step order (resumed runs included)."""
    return [r for r in read_metrics(run_dir) if any(k.startswith("eval/") for k in r)]


def mean_over_ranks(accelerator, values: dict[str, float]) -> dict[str, float]:
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], device=accelerator.device, dtype=torch.float64)
    t = accelerator.reduce(t, reduction="mean")
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def all_finite(accelerator, value: torch.Tensor) -> bool:
    """True when `value` is finite on every rank (ranks must agree, or DDP would hang)."""
    flag = torch.tensor(1.0 if bool(torch.isfinite(value.detach()).all()) else 0.0, device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)


# A weight beyond this makes a forward overflow even in float32 / bfloat16 range: norms square what it produces.
WEIGHT_LIMIT = math.sqrt(torch.finfo(torch.float32).max)


@torch.no_grad()
def largest_weight(accelerator, params) -> float:
    """max |w| over every tensor of `params` on every rank, NaN if any is NaN: one fused pass, one host sync."""
    local = [p for p in params if p.numel()]  # under ZeRO-3 a rank holds no whole parameter here
    peak = torch.zeros(1, device=accelerator.device)
    if local:
        peaks = torch._foreach_norm(local, float("inf"))  # max |x| of each tensor; a NaN stays NaN
        peak = torch.stack([p.to(accelerator.device, torch.float32) for p in peaks]).max().reshape(1)
    return float(accelerator.gather(peak).max())


def unusable_weights(peak: float) -> Optional[str]:
    """What is wrong with weights whose largest magnitude is `peak` (`largest_weight`), or None if nothing."""
    if peak <= WEIGHT_LIMIT:
        return None
    if not math.isfinite(peak):
        return "NaN/inf trainable weights"
    return f"a trainable weight of {peak:.3g} (past {WEIGHT_LIMIT:.2g}, a forward through it overflows)"


def format_line(metrics: dict[str, float], keys: list[str]) -> str:
    return " | ".join(f"{key.split('/')[-1]} {metrics[key]:.4g}" for key in keys if key in metrics)


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
