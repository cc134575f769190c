"""Memory per component, per stage and phase, from tensor walks and (on CUDA) allocator statistics.

    recorder = MemoryRecorder("ppo", model=model, optimizer=optimizer, enabled=cfg.profile_memory)
    with recorder.phase("generate"): ...
    recorder.write(run_dir, config={"model": asdict(model_args)})

Per phase: tensor-counted components (largest at entry, exit, `sample()`) and the transient memory: on CUDA
the peak above entry less the components' growth, on the CPU the allocator's events (`profiling.live`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import torch

from foundation.cli import first_line
from foundation.settings import ONLINE_RL_STAGES
from profiling import components as C
from profiling import device as D
from profiling.live import LiveFigures, LiveTimeline, vocabulary_size
from profiling.saved import SavedTensorMeter
from profiling.tensors import TensorLedger, count_tensors

# What the transient peak of a phase is, when the caller does not say (generate: the KV cache an eager decode
# grows; where a compiled decode's cache is held and counted, `_build` names the rest activations).
DEFAULT_TRANSIENT = {"generate": C.KV_CACHE, "optimizer_step": C.OPTIMIZER_TEMPORARIES}


@dataclass
class CudaFigures:
    allocated_before: int
    allocated_after: int
    peak_allocated: int
    peak_above_entry: int
    peak_reserved: int
    reserved_after: int
    nvml_used: Optional[int]
    nvml_total: Optional[int]
    nvml_reason: Optional[str]


@dataclass
class PhaseRecord:
    stage: str
    phase: str
    calls: int = 0
    seconds: float = 0.0
    components: dict[str, Optional[int]] = field(default_factory=dict)  # the stacked bar, bytes
    elsewhere: dict[str, dict[str, int]] = field(default_factory=dict)  # other devices (offloaded)
    paged: dict[str, int] = field(default_factory=dict)  # managed memory the allocator does not see
    cuda: Optional[CudaFigures] = None
    gpu_reason: Optional[str] = None  # why the GPU-only components are None
    saved_for_backward: Optional[int] = None
    live: Optional[LiveFigures] = None  # CPU: the allocator events' peak of what the phase allocated

    @property
    def total(self) -> int:
        return C.total(self.components)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        return out


class MemoryRecorder:
    """Collects PhaseRecords for one process; `enabled=False` makes every call a no-op."""

    def __init__(self, stage: str, model=None, optimizer=None, device: Optional[torch.device] = None,
                 budget_bytes: int = C.DEFAULT_BUDGET_BYTES, enabled: bool = True,
                 resident_label: Optional[str] = None, vocab_size: Optional[int] = None,
                 cpu_timeline: bool = True, context_at_start: Optional[int] = None) -> None:
        self.stage = stage
        self.context_at_start = context_at_start  # bytes of CUDA context measured at the run's start (its estimate's)
        self.enabled = enabled
        self.budget_bytes = budget_bytes
        self.model, self.optimizer = model, optimizer
        self._explicit_device = device
        self.device = D.normalize(device or _device_of(model))
        self.gpu_reason = D.cuda_unavailable_reason(self.device)
        # Tensors alive at phase entry that nothing walked owns: in PPO, the rollout being processed.
        self.resident_label = resident_label or (C.ROLLOUT_BUFFERS if stage in ONLINE_RL_STAGES else C.OTHER_TENSORS)
        self.records: dict[tuple[str, str], PhaseRecord] = {}
        self.extra: dict[str, object] = {}
        self.holders: list = []  # objects holding tensors for the model outside its tree (its decoder)
        self._open: list[dict] = []  # the phases entered and not yet left, outermost first
        self.vocab_size = vocab_size  # what makes a tensor logits on the CPU (default: the model's LM head)
        self.cpu_timeline = cpu_timeline  # CPU phases: transient peaks from the allocator's events
        self._live: Optional[LiveTimeline] = None  # CPU: one allocator timeline per outermost phase
        self._claims: dict[int, set[int]] = {}  # its marks -> addresses the tensor walk at that mark counted
        self._pending: list[tuple] = []  # phases left inside the outermost one, built when it ends
        self.peak_allocated = 0  # the largest CUDA peak any phase saw (each phase resets CUDA's counter)
        self.ended: Optional[dict] = None  # a run that stopped on an error: its step, phase and error
        from foundation.provenance import relative_command

        self.command = relative_command()

    def track(self, model=None, optimizer=None, holder=None, **extra) -> None:
        """Point the recorder at objects created later (the optimizer, a rollout buffer: component=tensors, a
        holder of tensors for the model: `profiling.tensors.add_model`)."""
        if holder is not None:
            self.holders.append(holder)
        if model is not None:
            self.model = model
            self.device = D.normalize(self._explicit_device or _device_of(model))
            self.gpu_reason = D.cuda_unavailable_reason(self.device)
        if optimizer is not None:
            self.optimizer = optimizer
        self.extra.update(extra)

    def count(self) -> TensorLedger:
        """One walk over the tracked model, its gradients, the optimizer and the extra tensors."""
        return count_tensors(self.model, self.optimizer, self.extra, self.holders)

    def sample(self) -> None:
        """Re-count inside a phase, e.g. after backward and before zero_grad frees the gradients."""
        if self.enabled and self._open:
            ledger = self.count()
            self._claim(ledger)
            for phase in self._open:
                phase["samples"].append(ledger)

    @contextmanager
    def phase(self, name: str, stage: Optional[str] = None, transient: Optional[str] = None,
              count_saved: bool = False) -> Iterator[None]:
        """Record the body as phase `name` of `stage`; `count_saved` also meters saved-for-backward bytes.

        Phases nest (PPO's update holds its optimizer steps): an inner phase is recorded on its own, and the
        outer phase's peak and tensor counts include what happened inside it.
        """
        if not self.enabled:
            yield
            return
        stage = stage or self.stage
        transient = transient or DEFAULT_TRANSIENT.get(name, C.ACTIVATIONS)
        dev = str(self.device)
        cuda = self.gpu_reason is None
        if cuda:
            self._fold_peak_into_open_phases()  # the reset below would lose the outer phases' peak so far
            allocated_before = D.begin_phase(self.device)
        entry = self.count()
        for outer in self._open:
            outer["samples"].append(entry)
        live = not cuda and self._start_live()
        mine = {"samples": [entry], "peak_allocated": 0, "peak_reserved": 0}
        start_mark = self._claim(entry) if live else None
        self._open.append(mine)
        meter = SavedTensorMeter(exclude=entry.storage_keys()) if count_saved else None
        start = time.perf_counter()
        try:
            if meter is not None:
                with meter.watch():
                    yield
            else:
                yield
        finally:
            seconds = time.perf_counter() - start
            self._open.pop()
            exit_count = self.count()
            end_mark = self._claim(exit_count) if live else None
            for outer in self._open:
                outer["samples"].append(exit_count)
            samples = mine["samples"] + [exit_count]
            cuda_figures = None
            if cuda:
                reading = D.read_allocator(self.device)
                nvml = D.read_nvml(self.device)
                peak_allocated = max(reading.peak_allocated, mine["peak_allocated"])
                peak_reserved = max(reading.peak_reserved, mine["peak_reserved"])
                self.peak_allocated = max(self.peak_allocated, peak_allocated)
                self._fold_peak_into_open_phases(peak_allocated, peak_reserved)
                cuda_figures = CudaFigures(
                    allocated_before=allocated_before, allocated_after=reading.allocated,
                    peak_allocated=peak_allocated, peak_above_entry=peak_allocated - allocated_before,
                    peak_reserved=peak_reserved, reserved_after=reading.reserved,
                    nvml_used=nvml.used, nvml_total=nvml.total, nvml_reason=nvml.reason,
                )
            saved = meter.bytes if meter is not None else None
            self._pending.append((stage, name, transient, dev, samples, cuda_figures, seconds, saved,
                                  (start_mark, end_mark)))
            if not self._open:  # the outermost phase: its timeline is complete, every phase in it can be built
                self._build_pending()

    # ---- the CPU allocator timeline -------------------------------------------------------------
    def _start_live(self) -> bool:
        """Whether this phase is on a CPU allocator timeline (one starts with each outermost phase)."""
        if self._live is not None:
            return True
        if self._open or self.device.type != "cpu" or not self.cpu_timeline:
            return False  # an outer phase could not start one (another profiler runs), or not a CPU
        timeline = LiveTimeline(self.vocab_size or vocabulary_size(self.model))
        if timeline.start():
            self._live = timeline
        return self._live is not None

    def _claim(self, ledger: TensorLedger) -> Optional[int]:
        """A mark on the timeline, with the CPU addresses `ledger` counted there; None off the timeline."""
        if self._live is None:
            return None
        mark = self._live.mark()
        self._claims[mark] = {ptr for dev, ptr in ledger.storage_keys() if dev == "cpu"}
        return mark

    def _build_pending(self) -> None:
        timeline, self._live = self._live, None
        if timeline is not None:
            timeline.stop()
        pending, claims = self._pending, self._claims
        self._pending, self._claims = [], {}
        for stage, name, transient, dev, samples, cuda_figures, seconds, saved, marks in pending:
            live = timeline.figures(*marks, claims) if timeline is not None and marks[0] is not None else None
            record = self._build(stage, name, transient, dev, samples, cuda_figures, live,
                                 with_logits=timeline is not None and timeline.vocab_size is not None)
            record.seconds = seconds
            record.saved_for_backward = saved
            self._keep(record)

    def _fold_peak_into_open_phases(self, allocated: Optional[int] = None, reserved: Optional[int] = None) -> None:
        """Carry the allocator's peak so far into every open phase (before a nested phase resets it)."""
        if not self._open:
            return
        if allocated is None:
            reading = D.read_allocator(self.device)
            allocated, reserved = reading.peak_allocated, reading.peak_reserved
        for phase in self._open:
            phase["peak_allocated"] = max(phase["peak_allocated"], allocated)
            phase["peak_reserved"] = max(phase["peak_reserved"], reserved)

    def _build(self, stage: str, name: str, transient: str, dev: str, samples: list[TensorLedger],
               cuda: Optional[CudaFigures], live: Optional[LiveFigures] = None,
               with_logits: bool = False) -> PhaseRecord:
        entry = samples[0].components(dev)
        counted: dict[str, int] = {}
        for ledger in samples:
            for component, size in ledger.components(dev).items():
                counted[component] = max(counted.get(component, 0), size)
        if transient == C.KV_CACHE and counted.get(C.KV_CACHE):  # a compiled decode's full-length cache, held
            transient = C.ACTIVATIONS  # and counted: the peak beyond it is the prompt's forward and the steps' work
        last = samples[-1]
        record = PhaseRecord(stage=stage, phase=name, components=dict(counted),
                             elsewhere=last.elsewhere(dev), paged=last.paged(), cuda=cuda,
                             gpu_reason=self.gpu_reason)
        # Tensors the caller tracked under the resident label are counted already; the rest is "other".
        resident = self.resident_label if self.resident_label not in counted else C.OTHER_TENSORS
        if cuda is None:
            if live is not None:
                record.live = live
                record.components[transient] = counted.get(transient, 0) + live.peak - live.logits_at_peak
                if with_logits:
                    record.components[C.LOGITS] = live.logits_at_peak
            record.components.update({c: None for c in (resident, transient, C.ALLOCATOR_OVERHEAD, C.CUDA_CONTEXT)
                                      if c not in record.components})
            return record
        # Paged optimizer buffers are managed memory, invisible to the allocator figures below.
        paged = sum(last.paged().values())
        entry_on_allocator = C.total(entry) - sum(samples[0].paged().values())
        paged_growth = max(0, max(sum(ledger.paged().values()) for ledger in samples) - sum(samples[0].paged().values()))
        grown = max(0, sum(max(0, counted.get(c, 0) - entry.get(c, 0)) for c in counted) - paged_growth)
        record.components[resident] = max(0, cuda.allocated_before - entry_on_allocator)
        record.components[transient] = counted.get(transient, 0) + max(0, cuda.peak_above_entry - grown)
        record.components[C.ALLOCATOR_OVERHEAD] = max(0, cuda.peak_reserved - cuda.peak_allocated)
        if cuda.nvml_used is not None:
            record.components[C.CUDA_CONTEXT] = max(0, cuda.nvml_used - cuda.reserved_after - paged)
        else:
            record.components[C.CUDA_CONTEXT] = None
        return record

    def _keep(self, record: PhaseRecord) -> None:
        """Repeated phases keep their largest occurrence (the one that decides whether a run fits)."""
        key = (record.stage, record.phase)
        old = self.records.get(key)
        if old is not None:
            record.calls, record.seconds = old.calls, old.seconds + record.seconds
            # The saved-for-backward meter runs on one occurrence only: keep its reading.
            saved = max((v for v in (old.saved_for_backward, record.saved_for_backward) if v is not None), default=None)
            if old.total > record.total:
                old.calls, old.seconds = record.calls, record.seconds
                record = old
            record.saved_for_backward = saved
        record.calls += 1
        self.records[key] = record

    # ---- results --------------------------------------------------------------------------------
    def stopped(self, step: int, phase: Optional[str], exc: BaseException) -> None:
        """Say in the record that the run stopped at `step`, in `phase` (None: outside every phase), on `exc`."""
        message = first_line(exc)
        self.ended = {"step": step, "stage": self.stage, "phase": phase,
                      "error": type(exc).__name__ + (f": {message}" if message != type(exc).__name__ else "")}

    def needs_gpu(self) -> list[str]:
        """Components this run could not measure, by name (empty on CUDA)."""
        missing = {c for r in self.records.values() for c, v in r.components.items() if v is None}
        return C.ordered(missing)

    def to_dict(self, config: Optional[dict] = None) -> dict:
        from foundation.provenance import provenance

        return {
            **provenance(self.device, command=self.command),
            "unit": "bytes",
            "budget_bytes": self.budget_bytes,
            "cuda_context_at_start": self.context_at_start,
            "ended": self.ended,  # None: the run took its steps
            "gpu_reason": self.gpu_reason,
            "needs_gpu": self.needs_gpu(),
            "config": config or {},
            "phases": [r.to_dict() for r in self.records.values()],
        }

    def write(self, run_dir, config: Optional[dict] = None) -> dict:
        """memory.json, memory.md and memory.png under `run_dir`; returns the paths written."""
        if not self.enabled or not self.records:  # e.g. a resumed run that had no step left to take
            return {}
        from profiling.report import write_reports

        return write_reports(self.to_dict(config), run_dir)


def _device_of(model) -> torch.device:
    if model is not None:
        for p in model.parameters():
            if p.device.type != "meta":
                return p.device
    return torch.device("cpu")
