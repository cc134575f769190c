"""One side of `benchmarks.stages_vs_trl`, in a process of its own (the parent starts it):

    python -m benchmarks.stage_side ours|trl SETTINGS_JSON SIDE_DIR

ours: the stage script's main with the workload as flags, its per-step times read back from its metrics log
and its rows from `benchmarks.row_trace`; trl: `benchmarks.trl_stages.run_trl`. Either way the process's peak
memory spans the side's whole run (the same span on both sides); all goes into SIDE_DIR/side.json.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from benchmarks.measure import log_to_stdout, release_memory, side_errors
from benchmarks.stages_vs_trl import ABLATIONS, StageWorkload, training_rows
from profiling import components as C
from profiling.device import MemoryProbe


def stage_argv(w: StageWorkload, output_dir: Path) -> list[str]:
    """The workload's model, data and train settings (and the stage's) as our stage script's flags."""
    argv = []
    for part in (w.model, w.data, w.train):
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if value is not None and f.name != "output_dir":
                argv += [f"--{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv + w.stage_flags() + ["--output_dir", str(output_dir)]


def run_ours(w: StageWorkload, side_dir: Path, result: dict) -> None:
    from benchmarks.row_trace import traced

    run_dir, trace_dir = side_dir / "run", side_dir / "trace"
    argv = stage_argv(w, run_dir)
    result["setup"] = {"class": f"trainer/{w.stage}.py (the stage script, in-process)", "argv": argv}
    with traced(trace_dir):
        importlib.import_module(f"trainer.{w.stage}").main(argv)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result["steps"] = [{"step": r["step"], "wall_s": r["perf/step_s"], "cpu_s": r.get("perf/step_cpu_s")}
                       for r in metrics if "perf/step_s" in r]
    result["trace"] = [json.loads(line)["rows"] for line in (trace_dir / "rows-rank0.jsonl").read_text().splitlines()]
    result["adapter"] = str(run_dir / "adapter")
    if (run_dir / "memory.json").is_file():  # --profile_memory true: the recorder's tensor walk
        result["memory"] = tensor_profile(json.loads((run_dir / "memory.json").read_text()))


def tensor_profile(memory: dict) -> Optional[dict]:
    """From our recorder's memory.json: the tensor-counted components of the largest forward_backward phase (what
    is alive with gradients, optimizer states included after the first step) and the bytes saved for backward over
    the first step's micro-batches; the figures TRL's side takes the same way (`trl_stages.profile_tensors`)."""
    phase = next((p for p in memory["phases"] if p["phase"] == "forward_backward"), None)
    if phase is None:
        return None
    # on the CPU the recorder also measures what the phase allocated (activations, logits): not tensor-counted
    transient = (C.ACTIVATIONS, C.LOGITS, C.KV_CACHE, C.OPTIMIZER_TEMPORARIES)
    resident = {k: v for k, v in phase["components"].items() if v is not None and k not in transient}
    return {"resident": resident, "saved_for_backward": phase.get("saved_for_backward")}


def run_trl_side(w: StageWorkload, side_dir: Path, result: dict, device: torch.device) -> None:
    from benchmarks.trl_stages import run_trl
    from benchmarks.workload import load_bench_tokenizer
    from trainer.engine.setup import simulate_gpu_memory

    simulate_gpu_memory(w.train.simulate_gpu_gib, device)  # the cap our stage script sets itself
    tokenizer = load_bench_tokenizer(w.model)
    run_trl(w, training_rows(w, tokenizer), tokenizer, device, side_dir, result)


def main(argv: Optional[list[str]] = None) -> dict:
    name, settings, side_dir = list(sys.argv[1:] if argv is None else argv)
    log_to_stdout()
    w = StageWorkload.from_dict(json.loads(Path(settings).read_text()))
    side_dir = Path(side_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "trl":  # imported before the span measured, as ours imports its trainer before it
        import trl  # noqa: F401
    import trainer.engine.harness  # noqa: F401

    probe = MemoryProbe(device)
    release_memory()
    result = {"side": name, "status": "ok", "error": None, "steps": [], "at_start": probe.now(),
              "load_average_at_start": os.getloadavg()}
    probe.reset()
    started = time.perf_counter()
    with side_errors(name, result):
        if name.startswith("ours"):
            run_ours(replace(w, train=replace(w.train, **ABLATIONS.get(name, {}))), side_dir, result)
        else:
            run_trl_side(w, side_dir, result, device)
    probe.sync()
    result["side_s"] = time.perf_counter() - started
    result.update(probe.peak())
    start_rss = result["at_start"].get("rss_bytes")
    result["peak_rss_above_start_bytes"] = (result["peak_rss_bytes"] - start_rss
                                            if result.get("peak_rss_bytes") and start_rss else None)
    result["load_average_at_end"] = os.getloadavg()
    (side_dir / "side.json").write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
