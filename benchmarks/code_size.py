"""How big the code is and how much a reader meets, at one or more git revisions, side by side.

    python -m benchmarks.code_size 8b403fe HEAD     # writes benchmarks/results/code_size/

For each revision (taken with `git archive` into a scratch folder, the working tree untouched): lines of
Python in trainer/, profiling/, foundation/, benchmarks/ (results left out) and tests/; the PPO and GRPO
settings (`--help` of the stage script, run from that tree); docstrings of more than 8 lines; README lines;
result folders.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.processes import main_at_revisions, revision_tree
from foundation.cli import run

FOLDERS = ("trainer", "profiling", "foundation", "benchmarks", "tests")
LONG_DOCSTRING = 8


def python_files(tree: Path, folder: str) -> list[Path]:
    return [p for p in (tree / folder).rglob("*.py") if "results" not in p.relative_to(tree).parts]


def long_docstrings(files: list[Path]) -> int:
    found = 0
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                found += bool(doc and len(doc.splitlines()) > LONG_DOCSTRING)
    return found


def settings(tree: Path, script: str) -> Optional[int]:
    """The flags `python SCRIPT --help` lists in that tree (None when the script is not there)."""
    if not (tree / script).is_file():
        return None
    done = subprocess.run([sys.executable, script, "--help"], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    return len(re.findall(r"^  --\w+", done.stdout, re.M)) if done.returncode == 0 else None


def figures(revision: str) -> dict:
    with revision_tree(revision) as (sha, tree):
        lines = {f: sum(len(p.read_text().splitlines()) for p in python_files(tree, f)) for f in FOLDERS}
        code = [p for f in FOLDERS[:4] for p in python_files(tree, f)]
        results = tree / "benchmarks" / "results"
        return {"revision": sha, "python_lines": lines, "ppo_settings": settings(tree, "trainer/ppo.py"),
                "grpo_settings": settings(tree, "trainer/grpo.py"),
                "docstrings_over_8_lines": long_docstrings(code),
                "readme_lines": len((tree / "README.md").read_text().splitlines()),
                "result_folders": sum(1 for p in results.iterdir() if p.is_dir()) if results.is_dir() else 0}


def markdown(data: dict) -> str:
    runs = data["revisions"]
    head = "| | " + " | ".join(f"`{r['revision']}`" for r in runs) + " |"
    lines = ["# Code size", "", f"- date: {data['date']}; git `{data['git_revision']}`", f"- command: `{data['command']}`",
             "", head, "|---|" + "---:|" * len(runs)]
    for folder in FOLDERS:
        lines.append(f"| Python lines in {folder}/ | " + " | ".join(str(r["python_lines"][folder]) for r in runs) + " |")
    for key, label in (("ppo_settings", "PPO settings (`trainer/ppo.py --help`)"),
                       ("grpo_settings", "GRPO settings (`trainer/grpo.py --help`)"),
                       ("docstrings_over_8_lines", "docstrings over 8 lines (trainer, profiling, foundation, benchmarks)"),
                       ("readme_lines", "README.md lines"), ("result_folders", "folders in benchmarks/results/")):
        lines.append(f"| {label} | " + " | ".join("-" if r[key] is None else str(r[key]) for r in runs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    return main_at_revisions("code_size", __doc__, figures, markdown, argv)


if __name__ == "__main__":
    run(main)
