"""Copy a run folder's small, generated files (no weights, no checkpoints) into benchmarks/results/.

    python -m benchmarks.collect_run runs/demo benchmarks/results/demo-smollm2-135m-cpu --note "make demo on a fresh clone"

Keeps every stage's config.json, results.json, metrics.jsonl, memory report and the
`evaluation*.json` files `python -m trainer.evaluate --output_file` wrote there, and the run's
report.md, curves.png and comparison.json, plus provenance.json (date, device, git revision,
the note). What the run itself wrote is copied as it is, never edited.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from foundation.cli import InputError, argument_parser, run
from foundation.files import write_atomic
from foundation.provenance import PROJECT_ROOT, provenance

STAGE_FILES = ("config.json", "results.json", "metrics.jsonl", "memory.json", "memory.md", "memory.png")
RUN_FILES = ("report.md", "curves.png", "comparison.json")


def collect(run_dir: Path, out: Path, note: str = "") -> list[Path]:
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run folder")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            copied.append(Path(shutil.copy2(run_dir / name, out / name)))
    for stage in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        names = list(STAGE_FILES) + sorted(p.name for p in stage.glob("evaluation*.json"))
        for name in names:
            if (stage / name).is_file():
                (out / stage.name).mkdir(exist_ok=True)
                copied.append(Path(shutil.copy2(stage / name, out / stage.name / name)))
    if not copied:
        raise InputError(f"{run_dir}: nothing to collect (no reports, results or metrics)")
    info = {**provenance(), "run_dir": os.path.relpath(run_dir, PROJECT_ROOT), "note": note,
            "files": [str(p.relative_to(out)) for p in copied]}
    write_atomic(out / "provenance.json", json.dumps(info, indent=2))
    return copied


def main(argv=None) -> None:
    parser = argument_parser("python -m benchmarks.collect_run", __doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--note", default="", help="what the run was, e.g. the commands behind it")
    args = parser.parse_args(argv)
    files = collect(args.run_dir, args.out_dir, args.note)
    print(f"collected {len(files)} files into {args.out_dir}")


if __name__ == "__main__":
    run(main)
