"""Where a report came from: device, date, command, git revision and library versions."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch


PROJECT_ROOT = Path(__file__).resolve().parent.parent
_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "deepspeed")
# Settings that change a run's speed or memory without showing in its command line: threads, the CUDA
# allocator, visible devices, glibc malloc's tunables (MALLOC_MMAP_THRESHOLD_ halves a CPU run's resident set).
_RECORDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")
_RECORDED_ENV_PREFIXES = ("MALLOC_",)


def git_revision(cwd: Path = PROJECT_ROOT) -> str:
    """`git rev-parse HEAD` (with '-dirty' when tracked files changed), else 'unknown'; $RLHF_GIT_REVISION,
    where set, wins: the GPU kit sets it to the revision its tree was prepared at (the copy's .git can be
    an older snapshot)."""
    import os

    if os.environ.get("RLHF_GIT_REVISION"):
        return os.environ["RLHF_GIT_REVISION"]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        # --no-optional-locks: status reads; it does not refresh the index into the user's repository
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev or "unknown"


def library_versions(names=_LIBRARIES) -> dict[str, Optional[str]]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def relative_path(value: str) -> str:
    """An absolute path made relative to the project root (provenance never names a machine's folders):
    /home/x/onebase/trainer/sft.py -> trainer/sft.py, /tmp/run -> ../../tmp/run; anything else as it is."""
    return os.path.relpath(value, PROJECT_ROOT) if value.startswith("/") else value


def relative_command(argv: Optional[list[str]] = None) -> str:
    """The command line with every absolute path made relative to the project root (`relative_path`)."""
    words = []
    for arg in sys.argv if argv is None else argv:
        head, sep, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        words.append(shlex.quote(head + sep + relative_path(value)))
    return " ".join(words)


def run_environment() -> dict[str, str]:
    """The environment variables of `_RECORDED_ENV` (and `MALLOC_*`) that are set, by name."""
    return {k: v for k, v in sorted(os.environ.items())
            if k in _RECORDED_ENV or k.startswith(_RECORDED_ENV_PREFIXES)}


def shown_command(data: dict) -> str:
    """A report's command as it can be run again: its recorded environment settings first."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in (data.get("environment") or {}).items())
    return f"{env} {data['command']}" if env else data["command"]


def provenance(device: Optional[torch.device] = None, command: Optional[str] = None) -> dict:
    device = device or torch.device("cpu")
    return {
        "device": str(device),
        "device_name": device_name(device),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else relative_command(),
        "environment": run_environment(),
        "git_revision": git_revision(),
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": library_versions(),
    }


def device_name(device: torch.device) -> str:
    """The GPU's name; for a CPU its model too, where the system tells it (ratios move with the CPU)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    arch = platform.processor() or platform.machine()
    model = cpu_model() if device.type == "cpu" else None
    return f"{device.type} ({model}, {arch})" if model else f"{device.type} ({arch})"


def cpu_model() -> Optional[str]:
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
