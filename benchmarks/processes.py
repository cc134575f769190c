"""A command run in a session of its own, stopped with all its children when its time runs out; a git
revision's tree to run commands in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
# The exit status of a benchmark whose time (--stop_at) ran out before any side gave a figure: its report says
# so, and the GPU kit counts the step cut, not done, so collecting it keeps the last run that measured.
EXIT_CUT = 3
CUT = "cut"  # a side whose time (--stop_at) ran out before or while it ran: no figure, not a failure


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


def main_at_revisions(name: str, doc: str, figures: Callable[..., dict], markdown: Callable[[dict], str],
                      argv: Optional[list[str]], options: Optional[dict[str, dict]] = None) -> dict:
    """The command line of a benchmark run at git revisions (`python -m benchmarks.NAME REV ...`): `figures`
    of each, written to benchmarks/results/NAME/ (result.json, and README.md from `markdown`) and printed.
    `options`: the benchmark's own flags (argparse keywords each), passed to `figures` and kept in the result."""
    import json
    import sys

    from foundation.cli import argument_parser
    from foundation.files import write_atomic
    from foundation.provenance import provenance

    parser = argument_parser(f"python -m benchmarks.{name}", doc.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="git revisions, oldest first")
    parser.add_argument("--out_dir", type=Path, default=ROOT / "benchmarks" / "results" / name)
    for flag, settings in (options or {}).items():
        parser.add_argument(flag, **settings)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    chosen = {flag.lstrip("-"): getattr(args, flag.lstrip("-")) for flag in options or {}}
    command = f"python -m benchmarks.{name} " + " ".join(
        [*args.revisions, *(f"--{key} {value}" for key, value in chosen.items() if value != parser.get_default(key))])
    data = {**provenance(command=command), **chosen, "revisions": [figures(r, **chosen) for r in args.revisions]}
    write_atomic(args.out_dir / "result.json", json.dumps(data, indent=2) + "\n")
    write_atomic(args.out_dir / "README.md", markdown(data))
    print(markdown(data))
    return data


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


def side_in_own_process(module: str, name: str, label: str, argv: list[str], own: Sequence[str],
                        flags: Sequence[str] = (), stop_at: float = 0.0) -> dict:
    """Side `name` of the benchmark `module` in a fresh Python process: this command again less the options
    `own`, for that side alone (plus `flags`), its record read back from a file. Nothing one side leaves in a
    process (compiled kernels, allocator state, thread pools) can then slow the next. With `stop_at` (Unix
    time) a side still running then is stopped: cut."""
    def record_of(status: str, error: str) -> dict:
        return {"side": name, "label": label, "status": status, "steps": [], "setup": {}, "error": error}

    left = stop_at - time.time() if stop_at else None
    if left is not None and left <= 0:
        return record_of(CUT, "the time given (--stop_at) was spent before this side started")
    with tempfile.TemporaryDirectory(prefix="bench-side-") as folder:
        record = Path(folder) / "side.json"
        command = [sys.executable, "-m", module, *without_options(argv, own), "--sides", name, *flags,
                   "--isolate", "false", "--side_run_out", str(record)]
        code = run_stoppable(command, left, cwd=ROOT)
        if code is None:
            return record_of(CUT, f"stopped after {left:.0f} s: the time given (--stop_at) ran out")
        if code == 0 and record.exists():
            return json.loads(record.read_text())
    return record_of("failed", f"its process exited with status {code} before writing its record")


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
