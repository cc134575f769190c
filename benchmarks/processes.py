"""A command run in a session of its own, stopped with all its children when its time runs out; a git
revision's tree to run commands in."""

from __future__ import annotations

import os
import signal
import subprocess
import tarfile
import tempfile
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path
from typing import Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def revision_tree(revision: str) -> Iterator[tuple[str, Path]]:
    """(short sha, scratch folder holding the revision's files, from `git archive`): the working tree untouched."""
    sha = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix=f"rev-{sha}-") as scratch:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(scratch, filter="data")
        yield sha, Path(scratch)


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
