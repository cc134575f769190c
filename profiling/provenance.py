"""Where a report came from: device, date, command, git revision and library versions."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from profiling.device import device_name

PROJECT_ROOT = Path(__file__).resolve().parent.parent
_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "deepspeed")


def git_revision(cwd: Path = PROJECT_ROOT) -> str:
    """`git rev-parse HEAD` (with '-dirty' when tracked files changed), or 'unknown' outside a checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev or "unknown"


def library_versions() -> dict[str, Optional[str]]:
    out = {}
    for name in _LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(device: Optional[torch.device] = None, command: Optional[str] = None) -> dict:
    device = device or torch.device("cpu")
    return {
        "device": str(device),
        "device_name": device_name(device),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(shlex.quote(a) for a in sys.argv),
        "git_revision": git_revision(),
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": library_versions(),
    }
