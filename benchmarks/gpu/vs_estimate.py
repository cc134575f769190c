"""A recorded run's memory against the estimator's prediction for the same settings, phase by phase.

    python -m benchmarks.gpu.vs_estimate RUN_DIR [RUN_DIR ...]

For each run folder (config.json and memory.json from `--profile_memory true`) the estimator runs on
the run's own saved settings, and each component of each phase is set beside it with the ratio
measured / predicted (the target: 0.85-1.15). A phase's whole figure is the device memory it holds: the
allocator's reserved bytes and the CUDA context, against the estimate's `device_total` (the peak phase's,
which the caching allocator keeps reserved through every phase). The estimate's CUDA context is what the run's
own estimate had: the context it measured at its start, and the kernels CUDA loads later as assumed; the
context a phase holds is measured. Writes vs_estimate.json and vs_estimate.md.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from foundation.cli import InputError, argument_parser, run
from foundation.files import write_atomic
from foundation.provenance import git_revision
from profiling import components as C
from profiling.predict import EstimateArguments, estimate, resolve_shape
from profiling.report import stopped_where, table_lines

TARGET = (0.85, 1.15)


def predicted_for(run_dir: Path) -> tuple[dict, dict, str]:
    """(the run's memory.json, the estimate of the run's saved settings on its device, where the estimate's CUDA
    context comes from): on CUDA the context the run measured at its start, which its own estimate used (a
    record without it: the estimator's assumption), plus the kernels the estimator assumes CUDA loads later."""
    config_file, memory_file = run_dir / "config.json", run_dir / "memory.json"
    for path in (config_file, memory_file):
        if not path.is_file():
            raise InputError(f"{path} is missing: the run stopped before its first step, or ran without "
                             "--profile_memory true")
    config, memory = json.loads(config_file.read_text()), json.loads(memory_file.read_text())
    stage = memory["phases"][0]["stage"] if memory["phases"] else "sft"
    device = "cuda" if str(memory.get("device", "")).startswith("cuda") else "cpu"
    # what the run settled (its plan) over the settings asked for
    sections = [SimpleNamespace(**config.get(k, {})) for k in ("plan", "model", "data", "train", "stage")]
    start = memory.get("cuda_context_at_start")
    extra = {"cuda_context_gib": start / C.GIB} if device == "cuda" and start else {}
    args = EstimateArguments.of_run(*sections, stage=stage, device=device, **extra)
    source = "the run measured it" if extra else "assumed: the record has no start figure"
    context = ("none (not CUDA)" if device != "cuda" else f"{args.cuda_context_gib:.3f} GiB at the start ({source}) "
               f"+ {args.cuda_kernels_gib:g} GiB for the kernels loaded as first called (assumed)")
    return memory, estimate(resolve_shape(args), args), context


def _ratio(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
    return measured / predicted if measured is not None and predicted else None


def compare(run_dir: Path, revision: Optional[str] = None) -> dict:
    """The comparison of one run folder, written there; `revision` is the estimator's (default: now)."""
    memory, est, context = predicted_for(run_dir)
    predicted = {p["phase"]: p for p in est["phases"]}
    phases = []
    for phase in memory["phases"]:
        guess = predicted.get(phase["phase"])
        if guess is None:
            continue
        rows = []
        for component in C.ordered(set(phase["components"]) | set(guess["components"])):
            m, p = phase["components"].get(component), guess["components"].get(component)
            rows.append({"component": component, "measured": m, "predicted": p, "ratio": _ratio(m, p)})
        cuda = phase.get("cuda") or {}
        measured_total = C.total(phase["components"])
        device = guess.get("device_total", guess["total"])  # the allocator keeps the peak phase's blocks
        phases.append({"phase": phase["phase"], "components": rows, "measured_total": measured_total,
                       "predicted_total": device, "total_ratio": _ratio(measured_total, device),
                       "measured_peak_allocated": cuda.get("peak_allocated"),
                       "predicted_peak_allocated": guess.get("peak_allocated"),
                       "peak_allocated_ratio": _ratio(cuda.get("peak_allocated"), guess.get("peak_allocated"))})
    within = [p["total_ratio"] for p in phases if p["total_ratio"] is not None]
    result = {"run": run_dir.name, "stage": est["phases"][0]["stage"], "device": memory.get("device"),
              "device_name": memory.get("device_name"), "date": memory.get("date"),
              "git_revision": memory.get("git_revision"), "command": memory.get("command"),
              "ended": memory.get("ended"),  # a run that stopped on an error: where (None: it took its steps)
              "estimate_settings": est["config"]["settings"], "estimate_cuda_context": context,
              "estimate_git_revision": revision or git_revision(),
              "estimate_date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "phases": phases, "target": list(TARGET),
              "all_within_target": bool(within) and all(TARGET[0] <= r <= TARGET[1] for r in within)}
    write_atomic(run_dir / "vs_estimate.json", json.dumps(result, indent=2))
    write_atomic(run_dir / "vs_estimate.md", markdown(result))
    return result


def _r(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(result: dict) -> str:
    lines = [f"# Measured vs estimated memory: {result['stage']} ({result['run']})", "",
             f"- measured on {result['device_name']} (`{result['device']}`), {result['date']}, git "
             f"`{result['git_revision']}`", f"- run command: `{result['command']}`",
             f"- estimate: `profiling.predict` on the run's own saved settings (git "
             f"`{result.get('estimate_git_revision', result['git_revision'])}`, {result.get('estimate_date', result['date'])}); "
             f"target ratio {TARGET[0]}-{TARGET[1]}",
             *([f"- the estimate's CUDA context: {result['estimate_cuda_context']}"] if "estimate_cuda_context" in result
               else []),
             *([f"- **{stopped_where(result['ended'])}**"] if result.get("ended") else []),
             "", *table_lines(["phase", "device memory, measured GiB", "estimated GiB", "ratio",
                               "peak allocated, measured / estimated GiB", "ratio"], "lrrrrr", [
                 [p["phase"], C.gib(p["measured_total"]), C.gib(p["predicted_total"]), _r(p["total_ratio"]),
                  f"{C.gib(p['measured_peak_allocated'])} / {C.gib(p['predicted_peak_allocated'])}",
                  _r(p["peak_allocated_ratio"])] for p in result["phases"]])]
    for p in result["phases"]:
        lines += ["", f"## {p['phase']}", "", *table_lines(
            ["component", "measured GiB", "estimated GiB", "ratio"], "lrrr",
            [[r["component"], C.gib(r["measured"]), C.gib(r["predicted"]), _r(r["ratio"])] for r in p["components"]])]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argument_parser("python -m benchmarks.gpu.vs_estimate", __doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    revision = git_revision()  # before any file is written: the files written would make the tree dirty
    results = [compare(d, revision) for d in args.run_dirs]
    for r in results:
        print(f"{r['run']}: " + ", ".join(f"{p['phase']} {_r(p['total_ratio'])}" for p in r["phases"]))
    return results


if __name__ == "__main__":
    run(main)
