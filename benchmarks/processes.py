"""A command run in a session of its own, stopped with all its children when its time runs out."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional, Sequence


def run_stoppable(argv: list[str], timeout: Optional[float], **popen) -> Optional[int]:
    """Run `argv` (keyword arguments go to Popen) and return its exit status; None when it was still running
    after `timeout` seconds and was stopped. Its own session, so the stop takes its children with it (compile
    workers, accelerate's and DeepSpeed's processes, which would otherwise keep the GPU busy)."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def without_options(argv: list[str], names: Sequence[str]) -> list[str]:
    """`argv` less the options `names` and their values (`--name value` or `--name=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif arg.split("=", 1)[0] not in names:
            out.append(arg)
    return out
