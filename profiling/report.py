"""Reports of a memory record: JSON (the source of truth), a Markdown table and a PNG chart.

    python -m profiling.report RUN_DIR [--budget-gib 24]

regenerates RUN_DIR/memory.md and RUN_DIR/memory.png from RUN_DIR/memory.json. The same layout
("phases", each with "components" in bytes) is used by the estimator, so an estimate renders too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from foundation.cli import InputError, UsageError, argument_parser, run
from foundation.files import write_atomic
from foundation.provenance import shown_command
from profiling import components as C
from profiling.chart import write_chart

JSON_NAME, MD_NAME, PNG_NAME = "memory.json", "memory.md", "memory.png"
REQUIRED_KEYS = ("device", "device_name", "date", "command", "git_revision", "config", "budget_bytes", "phases")


def table_lines(head: Sequence, align: str, rows: Iterable[Sequence] = ()) -> list[str]:
    """A Markdown table: the header, the alignment line (`align`: a letter a column, "r" right, else left), and
    a line a row. A cell None is blank ("| |"); "" is an empty cell ("|  |")."""
    return [table_row(head), "|" + "".join("---:|" if a == "r" else "---|" for a in align), *map(table_row, rows)]


def table_row(cells: Sequence) -> str:
    return "|" + "|".join(" " if c is None else f" {c} " for c in cells) + "|"


def _cell(value: Optional[int], size: int) -> str:
    return "n/a (GPU)" if value is None else f"{value / size:.3f}"


def markdown_table(data: dict) -> str:
    """Components down, phases across, GiB (MiB for small models) in the cells; total, budget, fit."""
    phases = data["phases"]
    names = C.ordered(c for p in phases for c in p["components"])
    totals = [C.total(p["components"]) for p in phases]
    unit, size = C.table_unit(max(totals, default=0))
    head = [f"component ({unit})"] + [f"{p['stage']}/{p['phase']}" for p in phases]
    budget = data.get("budget_bytes", C.DEFAULT_BUDGET_BYTES)
    rows = [[component, *(_cell(p["components"][component], size) if component in p["components"] else ""
                          for p in phases)] for component in names]
    rows += [["**total**", *(f"**{t / size:.3f}**" for t in totals)], ["budget", *(f"{budget / size:.3f}" for _ in phases)],
             ["fits", *("yes" if t <= budget else "**no**" for t in totals)]]
    return "\n".join(table_lines(head, "l" + "r" * len(phases), rows))


def markdown(data: dict) -> str:
    lines = [f"# Memory: {data.get('title') or 'recorded run'}", ""]
    lines += [f"- device: {data['device_name']} (`{data['device']}`)", f"- date: {data['date']}",
              f"- git revision: `{data['git_revision']}`", f"- command: `{shown_command(data)}`",
              f"- units: GiB = 2^30 bytes, MiB = 2^20 bytes; budget {C.gib(data['budget_bytes'])} GiB", ""]
    if data.get("ended"):
        lines += [f"**{stopped_where(data['ended'])}**; the phases below are those it recorded.", ""]
    lines += [markdown_table(data), ""]
    if data.get("needs_gpu"):
        lines.append(f"Not measured here ({data.get('gpu_reason')}): {', '.join(data['needs_gpu'])}. "
                     "These come from torch.cuda allocator statistics and NVML on a CUDA device; "
                     "the tensor-counted rows are exact on any device.")
        lines.append("")
    if any(phase.get("live") for phase in data["phases"]):
        lines.append("On this CPU the rows of what a phase adds (activations, logits, kv_cache, optimizer_temporaries) "
                     "are the largest sum of bytes allocated inside the phase and alive at once, from the CPU "
                     "allocator's events (profiling/live.py); logits are tensors with the vocabulary as last "
                     "dimension, and tensor-counted ones (gradients, optimizer states) are left out.")
        lines.append("")
    for phase in data["phases"]:
        for dev, parts in (phase.get("elsewhere") or {}).items():
            listed = ", ".join(f"{c} {C.human(v)}" for c, v in parts.items())
            lines.append(f"- {phase['stage']}/{phase['phase']}: also on {dev} (not in the table): {listed}")
        if phase.get("paged"):
            listed = ", ".join(f"{c} {C.human(v)}" for c, v in phase["paged"].items())
            lines.append(f"- {phase['stage']}/{phase['phase']}: paged (CUDA managed, can spill to host): {listed}")
        live = phase.get("live")
        if live:
            lines.append(f"- {phase['stage']}/{phase['phase']}: allocated inside the phase, alive at once (CPU "
                         f"allocator): at most {C.human(live['peak'])}, of it logits "
                         f"{C.human(live['logits_at_peak'])}; logits alone at most {C.human(live['logits_peak'])}, "
                         f"the rest alone {C.human(live['others_peak'])}")
        if phase.get("saved_for_backward") is not None:
            lines.append(f"- {phase['stage']}/{phase['phase']}: saved for backward (tensor hooks): "
                         f"{C.human(phase['saved_for_backward'])}")
    for note in data.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def stopped_where(ended: dict) -> str:
    """'The run stopped at step 2, in phase update: OutOfMemoryError: ...' from a record's `ended`."""
    phase = f"in phase {ended['phase']}" if ended.get("phase") else "outside the recorded phases"
    return f"The run stopped at step {ended['step']}, {phase}: {ended['error']}"


def _title(data: dict) -> str:
    return f"{data.get('title') or 'memory per phase'} - {data['device_name']} - {data['date']}"


def write_reports(data: dict, run_dir, json_name: str = JSON_NAME) -> dict[str, Path]:
    """Write JSON, Markdown and PNG for `data` into `run_dir`; returns {'json','md','png'} paths."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": run_dir / json_name}
    write_atomic(paths["json"], json.dumps(data, indent=2, sort_keys=False) + "\n")
    paths.update(render(data, run_dir, stem=Path(json_name).stem))
    return paths


def render(data: dict, run_dir, stem: str = "memory") -> dict[str, Path]:
    run_dir = Path(run_dir)
    md, png = run_dir / f"{stem}.md", run_dir / f"{stem}.png"
    write_atomic(md, markdown(data))
    write_chart(data["phases"], png, data["budget_bytes"], _title(data))
    return {"md": md, "png": png}


def load(path) -> dict:
    """A run folder (its memory.json) or a JSON file; checks the keys the reports rely on."""
    path = Path(path)
    if path.is_dir():
        path = path / JSON_NAME
    if not path.is_file():
        raise UsageError(f"no memory report at {path} (a run writes memory.json when profiling is on)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a memory report (a JSON object with {', '.join(REQUIRED_KEYS)})")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise InputError(f"{path}: not a memory report, missing keys {missing}")
    phases = data["phases"]
    if not isinstance(phases, list) or not all(isinstance(p, dict) and isinstance(p.get("components"), dict)
                                               and "stage" in p and "phase" in p for p in phases):
        raise InputError(f"{path}: 'phases' must be a list of {{stage, phase, components}} entries")
    return data


def main(argv: Optional[list[str]] = None) -> int:
    parser = argument_parser("python -m profiling.report", __doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run folder holding memory.json, or a memory/estimate JSON file")
    parser.add_argument("--budget-gib", type=float, default=None, help="redraw against this budget (GiB)")
    args = parser.parse_args(argv)
    source = Path(args.run_dir)
    data = load(source)
    if args.budget_gib is not None:
        data["budget_bytes"] = int(args.budget_gib * C.GIB)
    out_dir = source if source.is_dir() else source.parent
    stem = "memory" if source.is_dir() else source.stem
    for kind, path in render(data, out_dir, stem=stem).items():
        print(f"wrote {kind}: {path}")
    return 0


if __name__ == "__main__":
    run(main)
