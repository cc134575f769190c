"""Where one step's time goes: the step run once more under `torch.profiler`, its phases' wall-clock time
beside the device time their kernels took (a phase whose device is idle most of its wall time is
launch-bound, one whose device is busy is compute- or bandwidth-bound), and the ops ranked by their own
device time (CPU time where there is no CUDA device). Writes kernels.json and kernels.md to a folder.

The profiled step is an extra one, never one of the measured steps: the profiler slows what it watches.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.engine.phases import watching

TOP_OPS = 40
MARK = "phase:"  # the profiler ranges around each phase carry this prefix


class PhaseRanges:
    """A phase watcher: each phase a named profiler range, its wall-clock seconds summed by name."""

    def __init__(self, sync: Callable[[], None]):
        self.sync, self.wall = sync, {}

    @contextmanager
    def __call__(self, name: str, **_options):
        self.sync()
        start = time.perf_counter()
        with torch.profiler.record_function(MARK + name):
            yield
        self.sync()
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - start


def _self_time(event, on_device: bool) -> float:
    """An op's own time in microseconds: on the device where there is one (the attribute's name changed
    across torch versions), else on the CPU."""
    if not on_device:
        return event.self_cpu_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def _total_time(event, on_device: bool) -> float:
    if not on_device:
        return event.cpu_time_total
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def profile_step(step: Callable[[], Any], device: torch.device, out_dir: Path, title: str) -> dict:
    """Run `step` once under the profiler and write where its time went (kernels.json, kernels.md)."""
    on_device = device.type == "cuda"
    sync = torch.cuda.synchronize if on_device else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ranges = PhaseRanges(sync)
    sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof, watching(ranges):
        step()
        sync()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    clock = "device" if on_device else "cpu"
    phases = [{"phase": e.key.removeprefix(MARK), "wall_s": ranges.wall.get(e.key.removeprefix(MARK)),
               f"{clock}_s": _total_time(e, on_device) / 1e6, "calls": e.count}
              for e in events if e.key.startswith(MARK)]
    ops = [e for e in events if not e.key.startswith(MARK)]
    busy = sum(_self_time(e, on_device) for e in ops) / 1e6
    ranked = sorted(ops, key=lambda e: _self_time(e, on_device), reverse=True)[:TOP_OPS]
    report = {
        "title": title, "device": torch.cuda.get_device_name(device) if on_device else "cpu", "clock": clock,
        "wall_s": wall, f"{clock}_busy_s": busy, "phases": sorted(phases, key=lambda p: -(p["wall_s"] or 0.0)),
        "ops": [{"op": e.key, "calls": e.count, f"self_{clock}_s": _self_time(e, on_device) / 1e6,
                 "self_cpu_s": e.self_cpu_time_total / 1e6} for e in ranked],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=2))
    (out_dir / "kernels.md").write_text(render(report))
    return report


def render(report: dict) -> str:
    clock = report["clock"]
    busy = report[f"{clock}_busy_s"]
    lines = [f"# Where one step's time went: {report['title']}", "",
             f"- device: {report['device']}; one step run under torch.profiler after the measured ones "
             "(the profiler slows it: read shares, not seconds)",
             f"- wall-clock {report['wall_s']:.3f} s; {clock} busy (ops' own time summed) {busy:.3f} s", "",
             f"| phase | wall s | {clock} s (its ops) | {clock} busy |", "|---|---:|---:|---:|"]
    for p in report["phases"]:
        wall = p["wall_s"]
        share = "-" if not wall else f"{p[f'{clock}_s'] / wall:.0%}"
        lines.append(f"| {p['phase']} | {'-' if wall is None else f'{wall:.3f}'} | {p[f'{clock}_s']:.3f} | {share} |")
    lines += ["", f"The {len(report['ops'])} ops with the most {clock} time of their own:", "",
              f"| op | calls | own {clock} s | share of busy | own CPU s |", "|---|---:|---:|---:|---:|"]
    for op in report["ops"]:
        own = op[f"self_{clock}_s"]
        name = " ".join(op["op"].split()).replace("|", "\\|")
        name = name if len(name) <= 90 else name[:90] + "..."
        lines.append(f"| `{name}` | {op['calls']} | {own:.4f} | {own / busy:.1%} | {op['self_cpu_s']:.4f} |"
                     if busy else f"| `{name}` | {op['calls']} | {own:.4f} | - | {op['self_cpu_s']:.4f} |")
    return "\n".join(lines) + "\n"
