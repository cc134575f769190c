"""Wall time and peak memory per phase, read the same way for every side of a benchmark.

On CUDA the figures are the caching allocator's (`max_memory_allocated` / `max_memory_reserved`,
reset at each phase boundary) plus NVML's device-wide reading; on CPU they are the process's
resident set: its peak (VmHWM) is reset at each boundary through /proc/self/clear_refs, so two
sides run one after the other in one process each get their own peak. A figure the device cannot
give is None, never estimated.
"""

from __future__ import annotations

import ctypes
import gc
import re
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> Optional[int]:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> Optional[int]:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Set the peak resident set (VmHWM) back to the current one (Linux 4.0+); False where not possible."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def release_memory() -> None:
    """Return freed memory: Python garbage, the CUDA cache, and glibc's free heap pages (CPU RSS)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryProbe:
    """Peak memory since the last `reset()` on one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.rss_resettable = reset_peak_rss()
        self.nvml_max: Optional[int] = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()

    def now(self) -> dict[str, Optional[int]]:
        if self.cuda:
            return {"allocated_bytes": torch.cuda.memory_allocated(self.device),
                    "reserved_bytes": torch.cuda.memory_reserved(self.device), "rss_bytes": rss_bytes()}
        return {"allocated_bytes": None, "reserved_bytes": None, "rss_bytes": rss_bytes()}

    def peak(self) -> dict[str, Optional[int]]:
        if self.cuda:
            self._read_nvml()
            return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device), "peak_rss_bytes": None}
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "peak_rss_bytes": peak_rss_bytes()}

    def _read_nvml(self) -> None:
        from profiling.device import read_nvml

        used = read_nvml(self.device).used
        if used is not None:
            self.nvml_max = max(self.nvml_max or 0, used)


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
