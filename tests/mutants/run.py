"""Apply each one-line mutation of the RL wiring and sampling alone and report which fast tests fail on it.

    .venv/bin/python tests/mutants/run.py                      # every *.patch here, on the DEFAULT_FILES tests
    .venv/bin/python tests/mutants/run.py 05-*.patch --files tests/test_rl_wiring.py tests/test_ppo.py

--files takes test files or pytest node ids (file::test). The patches go onto a scratch git worktree at HEAD
(the checkout itself is never touched), with the test files named by --files (and tests/conftest.py) copied
in from the checkout, so uncommitted test edits count. First a run with no mutation, which must pass; then one
pytest run per patch (`-m "not slow"`, no -x: every failing test is listed). Prints a table: mutation, failing
tests. A mutation no test fails on ("SURVIVED") makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Tests that together catch every patch here: the RL wiring's, and of the decode tests (minutes of compiles)
# the one that counts draws at a temperature.
DEFAULT_FILES = ["tests/test_rl_wiring.py",
                 "tests/test_decode.py::test_draws_at_a_temperature_follow_the_softmax_of_the_logits_over_it_once"]


def git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def failing_tests(tree: Path, files: list[str]) -> tuple[list[str], str]:
    """(names of the failing tests, the last lines of pytest's output)."""
    env = {**os.environ, "RLHF_DATA": os.environ.get("RLHF_DATA") or str(ROOT.parent / "shared" / "data" / "hh-rlhf")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rfE",
                           *files], cwd=tree, env=env, capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", proc.stdout, flags=re.MULTILINE)
    tail = "\n".join(proc.stdout.strip().splitlines()[-3:])
    if proc.returncode not in (0, 1):  # collection error, interrupted, no tests
        failed = failed or [f"pytest exit {proc.returncode}"]
    return [name.split("::", 1)[-1] for name in failed], tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patches", nargs="*", help="patch files (default: every *.patch beside this script)")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="test files or node ids to run")
    args = parser.parse_args()
    patches = [Path(p).resolve() for p in args.patches] or sorted(HERE.glob("*.patch"))
    tree = Path(tempfile.mkdtemp(prefix="mutants-")) / "tree"
    added = git("worktree", "add", "--detach", str(tree), "HEAD")
    if added.returncode:
        print(added.stderr, file=sys.stderr)
        return 2
    rows, survived = [], False
    try:
        for name in {*(f.split("::", 1)[0] for f in args.files), "tests/conftest.py"}:
            shutil.copy2(ROOT / name, tree / name)
        failed, tail = failing_tests(tree, args.files)
        if failed:
            print(f"the unmutated tree fails: {', '.join(failed)}\n{tail}", file=sys.stderr)
            return 2
        print(f"baseline (HEAD {git('rev-parse', '--short', 'HEAD').stdout.strip()}): {tail.splitlines()[-1]}",
              flush=True)
        for patch in patches:
            applied = git("apply", str(patch), cwd=tree)
            if applied.returncode:
                rows.append((patch.stem, "DOES NOT APPLY: " + applied.stderr.strip().splitlines()[0]))
                survived = True
                continue
            try:
                failed, _ = failing_tests(tree, args.files)
            finally:
                git("apply", "-R", str(patch), cwd=tree)
            survived |= not failed
            rows.append((patch.stem, ", ".join(failed) or "SURVIVED"))
            print(f"{patch.stem}: {len(failed)} failing", file=sys.stderr, flush=True)
    finally:
        git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tree.parent, ignore_errors=True)
    width = max(len(r[0]) for r in rows) if rows else 8
    print(f"\n{'mutation':<{width}}  failing tests")
    for mutation, tests in rows:
        print(f"{mutation:<{width}}  {tests}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
