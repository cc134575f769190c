"""Device-side readings: torch.cuda allocator statistics and the pynvml device total.

Every reader returns either figures or a one-line reason why there are none; none of them raises
on a machine without a GPU, and none of them invents a figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


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
