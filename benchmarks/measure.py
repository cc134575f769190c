"""Wall time and peak memory per phase, read the same way for every side of a benchmark: the memory
figures are profiling.device's MemoryProbe, reset at each phase boundary; and how a side that breaks is
recorded, so the other sides' figures stay."""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from profiling.device import MemoryProbe

logger = logging.getLogger(__name__)


def log_to_stdout() -> None:
    """A benchmark's progress lines, timestamped, on stdout (where the GPU kit's logs collect them)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)


@contextmanager
def side_errors(name: str, result: dict) -> Iterator[None]:
    """A side that runs out of memory or fails: its status and error in `result`, not an exception."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        result.update(status="out_of_memory", error=f"{type(exc).__name__}: {str(exc)[:500]}")
        logger.error("%s ran out of memory: %s", name, str(exc)[:300])
    except Exception as exc:
        result.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:500]}")
        logger.exception("%s failed", name)


def release_memory() -> None:
    """Return freed memory: Python garbage, the CUDA cache, and glibc's free heap pages (CPU RSS)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Lap:
    """One phase: wall seconds, this process's CPU seconds (all threads), and its peak memory.

    On a shared CPU machine the CPU seconds are the steadier figure: other jobs stretch wall time,
    not the work this process does.
    """

    seconds: float
    cpu_seconds: float
    peaks: dict[str, Optional[int]]


class PhaseClock:
    """Consecutive phases of a step: `start()`, then `lap()` at each boundary -> (seconds, peaks).

    Every boundary synchronizes the device first, so a phase is charged for its own kernels.
    `subphase(name)` times a part of the current phase (no memory reset) into `self.parts`.
    """

    def __init__(self, probe: MemoryProbe):
        self.probe = probe
        self.t, self.cpu_t = time.perf_counter(), time.process_time()
        self.parts: dict[str, float] = {}

    def start(self) -> None:
        self.probe.sync()
        self.probe.reset()
        self.parts = {}
        self.t, self.cpu_t = time.perf_counter(), time.process_time()

    def lap(self) -> Lap:
        self.probe.sync()
        now, cpu_now = time.perf_counter(), time.process_time()
        lap = Lap(now - self.t, cpu_now - self.cpu_t, self.probe.peak())
        self.t, self.cpu_t = now, cpu_now
        self.probe.reset()
        return lap

    @contextmanager
    def subphase(self, name: str) -> Iterator[None]:
        self.probe.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.probe.sync()
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0


class StepCounter:
    """Counts the real optimizer steps (a post-step hook: skipped accumulation steps do not count)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.count = 0
        self._handle = inner.register_step_post_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count

    def remove(self) -> None:
        self._handle.remove()


def merge_peaks(*peaks: dict[str, Optional[int]]) -> dict[str, Optional[int]]:
    """Field-wise maximum of several peak readings (None where no reading had a figure)."""
    out: dict[str, Optional[int]] = {}
    for reading in peaks:
        for key, value in reading.items():
            if value is not None:
                out[key] = max(out.get(key) or 0, value)
            else:
                out.setdefault(key, None)
    return out


def step_record(step: int, warmup: bool, rollout: Lap, update: Lap, parts: dict[str, float], **extra) -> dict:
    """One PPO step's figures, the same fields for every side."""
    return {"step": step, "warmup": warmup, "rollout_s": rollout.seconds, "update_s": update.seconds,
            "step_s": rollout.seconds + update.seconds, "rollout_cpu_s": rollout.cpu_seconds,
            "update_cpu_s": update.cpu_seconds, "step_cpu_s": rollout.cpu_seconds + update.cpu_seconds,
            "generate_s": parts.get("generate"), "rollout_parts_s": dict(parts), **extra,
            "rollout_peak": rollout.peaks, "update_peak": update.peaks, "peak": merge_peaks(rollout.peaks, update.peaks)}
