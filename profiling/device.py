"""Device-side readings: torch.cuda allocator statistics, the pynvml device total, and on CPU the
process's resident set.

Every reader returns either figures or a one-line reason why there are none; none of them raises
on a machine without a GPU, and none of them invents a figure.
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def cuda_unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """None when allocator statistics can be read for `device`, else why not."""
    if device is not None and device.type != "cuda":
        return f"profiled device is {device.type}, not CUDA: allocator statistics exist only for CUDA devices"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is a CPU-only build (no CUDA allocator)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no CUDA device visible)"
    return None


@dataclass
class AllocatorSample:
    allocated: int
    reserved: int
    peak_allocated: int  # since the last reset_peak()
    peak_reserved: int


def begin_phase(device: torch.device) -> int:
    """Allocated bytes now, with the peak statistics reset so the next reading is this phase's."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def read_allocator(device: torch.device) -> AllocatorSample:
    # Pending kernels may still allocate; the figures are meant for the end of a phase.
    torch.cuda.synchronize(device)
    return AllocatorSample(
        allocated=torch.cuda.memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
        peak_allocated=torch.cuda.max_memory_allocated(device),
        peak_reserved=torch.cuda.max_memory_reserved(device),
    )


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


def peak_bytes(device: torch.device) -> tuple[int, str]:
    """(peak bytes, "gpu") from the CUDA allocator, or on CPU (the process's peak resident set, "rss")."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "gpu"
    return peak_rss_bytes(), "rss"


class MemoryProbe:
    """Peak memory since the last `reset()` on one device: the allocator's on CUDA (reset at each phase
    boundary), the resident set's on CPU (its peak reset through /proc/self/clear_refs, so two sides run
    one after the other in one process each get their own peak); a figure the device cannot give is None."""

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
            used = read_nvml(self.device).used
            if used is not None:
                self.nvml_max = max(self.nvml_max or 0, used)
            sample = read_allocator(self.device)
            return {"peak_allocated_bytes": sample.peak_allocated, "peak_reserved_bytes": sample.peak_reserved,
                    "peak_rss_bytes": None}
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "peak_rss_bytes": peak_rss_bytes()}


@dataclass
class NvmlReading:
    used: Optional[int]  # whole device, all processes and CUDA contexts included
    total: Optional[int]
    name: Optional[str]
    reason: Optional[str]  # set when the figures are None


def read_nvml(device: Optional[torch.device] = None) -> NvmlReading:
    """Device-wide used/total bytes from NVML, or the reason NVML cannot be read here."""
    def query(pynvml, handle):
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return int(info.used), int(info.total), name.decode() if isinstance(name, bytes) else name

    figures, reason = _nvml(device, query)
    return NvmlReading(*(figures or (None, None, None)), reason)


def _nvml(device: Optional[torch.device], query: Callable) -> tuple[Any, Optional[str]]:
    """(query(pynvml, the device's NVML handle), None), or (None, why NVML cannot be read here)."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None, "NVML library not found (no NVIDIA driver on this machine)"
    except pynvml.NVMLError_DriverNotLoaded:
        return None, "NVIDIA driver not loaded (NVML cannot start)"
    except pynvml.NVMLError as exc:
        return None, f"NVML cannot start ({exc})"
    try:
        return query(pynvml, pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))), None
    except pynvml.NVMLError as exc:  # e.g. no device at that index, insufficient permissions
        return None, f"NVML query failed: {exc}"
    finally:
        pynvml.nvmlShutdown()


def warm_up(device: torch.device) -> None:
    """Start CUDA on `device` with cuBLAS in it (one small bf16 matmul): what every run holds from its first
    step on, so that `cuda_context_bytes` reads it at start."""
    torch.cuda.init()
    x = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (x @ x).sum().item()
    del x


def cuda_context_bytes(device: torch.device) -> tuple[Optional[int], Optional[str]]:
    """(bytes this process holds on `device` outside PyTorch's allocator - its CUDA context, loaded kernels,
    library workspaces: NVML's figure for this process less what the allocator reserved, None) or (None, why
    NVML cannot say: no GPU, no pynvml, or process ids a container hides from it)."""
    import os

    reason = cuda_unavailable_reason(device)
    if reason:
        return None, reason
    mine, reason = _nvml(device, lambda pynvml, handle: [
        p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()])
    if reason:
        return None, reason
    if not mine or mine[0] is None:
        return None, "NVML lists no memory for this process (its process ids are the host's, not this container's)"
    return max(0, int(mine[0]) - torch.cuda.memory_reserved(device)), None


def _nvml_index(device: Optional[torch.device]) -> int:
    """NVML numbers devices physically; CUDA_VISIBLE_DEVICES renumbers them for torch."""
    import os

    index = device.index if device is not None and device.index is not None else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(ids) and ids[index].isdigit():
            return int(ids[index])
    return index


def normalize(device: torch.device) -> torch.device:
    """'cuda' -> 'cuda:N' (the current device), so it compares equal to the devices tensors report."""
    if device.type == "cuda" and device.index is None and cuda_unavailable_reason(device) is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
    return None
