"""Where one step's time goes: the step run once more with the phases named (by default scoring and the
update) each under `torch.profiler`: every phase's wall-clock time, beside the device time its kernels
took for the profiled ones (a phase whose device idles most of its wall time is launch-bound; one whose
device is busy is compute- or bandwidth-bound), and the profiled phases' ops ranked by their own device
time (CPU time where there is no CUDA device). Writes kernels.json and kernels.md to a folder.

The profiled step is an extra one, never one of the measured steps: the profiler slows what it watches. Only
the phases named are profiled because a rollout's thousands of decode steps make the profiler's own
bookkeeping outlast the step at 7B; the decode benchmark profiles decoding.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from profiling.report import table_lines
from trainer.engine.phases import watching

TOP_OPS = 40
MARK = "phase:"  # the profiler ranges around each phase carry this prefix


def _self_time(event, on_device: bool) -> float:
    """An op's own time in microseconds: on the device where there is one (the attribute's name changed
    across torch versions), else on the CPU."""
    if not on_device:
        return event.self_cpu_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


class PhaseProfiler:
    """A phase watcher: every phase's wall-clock seconds summed by name; each outermost phase named in
    `profiled` runs under a profiler session of its own, nested phases marked as ranges inside it, and
    the session's ops and ranges are summed by name."""

    def __init__(self, device: torch.device, profiled: Iterable[str]):
        self.on_device = device.type == "cuda"
        self.sync = torch.cuda.synchronize if self.on_device else (lambda: None)
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_device:
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiled, self.active = set(profiled), None
        self.wall: dict[str, float] = {}
        self.busy: dict[str, float] = {}  # profiled phase -> seconds its kernels ran (`_busy`)
        self.ops: dict[str, dict] = {}
        self.overhead_s = 0.0  # the profiler's own starts, stops and bookkeeping, left out of the wall times

    @contextmanager
    def __call__(self, name: str, **_options):
        self.sync()
        session, opened = None, time.perf_counter()
        if self.active is None and name in self.profiled:
            session = torch.profiler.profile(activities=self.activities)
            session.__enter__()
            self.active = name
        start = time.perf_counter()
        self.overhead_s += start - opened
        try:
            with torch.profiler.record_function(MARK + name):
                yield
        finally:
            self.sync()
            end = time.perf_counter()
            self.wall[name] = self.wall.get(name, 0.0) + end - start
            if session is not None:
                session.__exit__(None, None, None)
                self.active = None
                self._add(session.key_averages())
                self.busy[name] = self.busy.get(name, 0.0) + self._busy(session.events())
            self.overhead_s += time.perf_counter() - end

    def _busy(self, events) -> float:
        """Seconds the device ran kernels in one session (the CPU's own op time where there is no device):
        each kernel once. Summing ops' own device time would count every kernel twice (the op that launched
        it and the kernel itself), and a range's device time takes in the annotation the profiler marks it
        with on the device."""
        ops = [e for e in events if not getattr(e, "is_user_annotation", False) and not e.name.startswith(MARK)]
        if not self.on_device:
            return sum(e.self_cpu_time_total for e in ops) / 1e6
        kernels = (e for e in ops if e.device_type != torch.autograd.DeviceType.CPU)
        return sum(e.time_range.elapsed_us() for e in kernels) / 1e6

    def _add(self, events) -> None:
        for e in events:
            if e.key.startswith(MARK) or getattr(e, "is_user_annotation", False):
                continue
            op = self.ops.setdefault(e.key, {"op": e.key, "calls": 0, "self_s": 0.0, "self_cpu_s": 0.0})
            op["calls"] += e.count
            op["self_s"] += _self_time(e, self.on_device) / 1e6
            op["self_cpu_s"] += e.self_cpu_time_total / 1e6


def profile_step(step: Callable[[], Any], device: torch.device, out_dir: Path, title: str,
                 phases: Iterable[str] = ("score", "update")) -> dict:
    """Run `step` once, the phases named under the profiler, and write where its time went."""
    watcher = PhaseProfiler(device, phases)
    watcher.sync()
    start = time.perf_counter()
    with watching(watcher):
        step()
        watcher.sync()
    wall = time.perf_counter() - start - watcher.overhead_s
    clock = "device" if watcher.on_device else "cpu"
    ops = sorted(watcher.ops.values(), key=lambda op: op["self_s"], reverse=True)
    report = {
        "title": title, "device": torch.cuda.get_device_name(device) if watcher.on_device else "cpu",
        "clock": clock, "wall_s": wall, "profiler_overhead_s": watcher.overhead_s, "profiled_phases": sorted(watcher.profiled),
        "busy_s": sum(watcher.busy.values()),
        "phases": [{"phase": name, "wall_s": seconds, "ops_s": watcher.busy.get(name)}
                   for name, seconds in sorted(watcher.wall.items(), key=lambda item: -item[1])],
        "ops": ops[:TOP_OPS],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=2))
    (out_dir / "kernels.md").write_text(render(report))
    return report


def render(report: dict) -> str:
    clock, busy = report["clock"], report["busy_s"]
    lines = [f"# Where one step's time went: {report['title']}", "",
             f"- device: {report['device']}; one step run after the measured ones, its "
             f"{', '.join(report['profiled_phases'])} phase(s) under torch.profiler (which slows them: read "
             "shares, not seconds)",
             f"- wall-clock {report['wall_s']:.3f} s (the profiler's starts, stops and bookkeeping, "
             f"{report['profiler_overhead_s']:.3f} s, left out); {clock} busy in the profiled phases (each kernel "
             f"once) {busy:.3f} s", ""]
    rows = []
    for p in report["phases"]:
        ops_s = p["ops_s"]
        share = "-" if ops_s is None or not p["wall_s"] else f"{ops_s / p['wall_s']:.0%}"
        rows.append([p["phase"], f"{p['wall_s']:.3f}", "-" if ops_s is None else f"{ops_s:.3f}", share])
    lines += table_lines(["phase", "wall s", f"{clock} s (its kernels; nested phases in their outer one's)",
                          f"{clock} busy"], "lrrr", rows)
    lines += ["", f"The {len(report['ops'])} ops of the profiled phases with the most {clock} time of their own (an "
              "op's own device time is that of the kernels it launched, which are listed too):", ""]
    rows = []
    for op in report["ops"]:
        name = " ".join(op["op"].split()).replace("|", "\\|")
        name = name if len(name) <= 90 else name[:90] + "..."
        share = f"{op['self_s'] / busy:.1%}" if busy else "-"
        rows.append([f"`{name}`", op["calls"], f"{op['self_s']:.4f}", share, f"{op['self_cpu_s']:.4f}"])
    lines += table_lines(["op", "calls", f"own {clock} s", "share of busy", "own CPU s"], "lrrrr", rows)
    return "\n".join(lines) + "\n"
