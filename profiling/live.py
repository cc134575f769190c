"""The peak of live tensor bytes inside a phase on the CPU, read off the allocator's own events.

One `torch.profiler` session (`profile_memory=True`) spans the outermost phase; marks cut it at phase
entries, exits and `sample()` calls. A phase's allocations are replayed in order and the largest running sum
is its transient peak, leaving out what was resident at entry and what a tensor walk counted. An allocation
is logits when an operator read it with the vocabulary as its last dimension. Exact for torch's CPU
allocator; memory a library allocates itself (oneDNN scratch, the Python heap) is not seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

MARK = "memory_recorder.mark"  # the record_function name of a mark
ALLOC, FREE, MARK_EVENT = 0, 1, 2  # kinds of timeline events


@dataclass
class LiveFigures:
    """Bytes allocated inside one phase and alive at once (tensor-walked allocations left out)."""

    peak: int  # the largest sum, logits included
    logits_at_peak: int  # the logits' part of `peak`
    logits_peak: int  # the largest sum of logits alone
    others_peak: int  # the largest sum of everything but logits
    allocations: int  # allocations the phase made


class LiveTimeline:
    """One profiler session of allocations, frees and marks, in the order they happened."""

    def __init__(self, vocab_size: Optional[int] = None) -> None:
        self.vocab_size = vocab_size
        self._profiler = None
        self._marks = 0
        self._at: dict[int, int] = {}  # mark -> its index in `events`
        # (time ns, kind, address or mark number, ALLOC: (number, bytes, read as logits))
        self.events: list[tuple] = []

    def start(self) -> bool:
        """Begin recording; False when it cannot (another profiler is running)."""
        # kineto prints two lines to stderr at every start and stop unless its log level is above them
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        profiler = torch.autograd.profiler.profile(profile_memory=True, record_shapes=self.vocab_size is not None)
        try:
            profiler.__enter__()
        except RuntimeError:
            return False
        self._profiler = profiler
        return True

    def mark(self) -> int:
        """A point in the timeline; returns its number (1, 2, ...)."""
        self._marks += 1
        with torch.profiler.record_function(MARK):
            pass
        return self._marks

    def stop(self) -> None:
        """End recording and put the events in time order."""
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        events, logits = [], set()
        stack = list(profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            fields = event.extra_fields
            size = getattr(fields, "alloc_size", None)
            if size is not None:  # an allocation (> 0) or a free (< 0)
                if size and fields.device.type == "cpu":
                    events.append((event.start_time_ns, ALLOC if size > 0 else FREE, fields.ptr,
                                   (fields.allocation_id, size)))
            elif event.name == MARK:
                events.append((event.start_time_ns, MARK_EVENT, 0, None))
            else:
                if self.vocab_size is not None:
                    logits.update(_vocabulary_inputs(fields, self.vocab_size))
                stack.extend(event.children)
        events.sort(key=lambda e: e[0])
        marks = 0
        for i, (t, kind, ptr, info) in enumerate(events):
            if kind == MARK_EVENT:
                marks += 1
                events[i] = (t, kind, marks, None)
                self._at[marks] = i
            elif kind == ALLOC:  # numbered by position: the profiler's ids need record_shapes
                events[i] = (t, kind, ptr, (i, info[1], info[0] in logits))
        self.events = events

    def figures(self, start: int, end: int, claims: dict[int, set[int]]) -> LiveFigures:
        """The live figures between marks `start` and `end`. `claims[mark]`: the addresses a tensor walk at
        that mark counted; their allocations are left out of the sums, from the moment they were made."""
        window = self.events[self._at[start]:self._at[end] + 1]
        live: dict[int, tuple] = {}
        claimed: set[int] = set()
        for _, kind, ptr, info in window:
            if kind == ALLOC:
                live[ptr] = info
            elif kind == FREE:
                live.pop(ptr, None)
            elif ptr in claims:  # a mark
                claimed.update(info[0] for addr, info in live.items() if addr in claims[ptr])
        live.clear()
        total = logits = peak = logits_at_peak = logits_peak = others_peak = allocations = 0
        for _, kind, ptr, info in window:
            if kind == ALLOC:
                allocations += 1
                number, size, is_logits = info
                if number in claimed:
                    continue
                live[ptr] = info
                total += size
                if is_logits:
                    logits += size
                    logits_peak = max(logits_peak, logits)
                else:
                    others_peak = max(others_peak, total - logits)
                if total > peak:
                    peak, logits_at_peak = total, logits
            elif kind == FREE and ptr in live:
                _, size, is_logits = live.pop(ptr)
                total -= size
                logits -= size if is_logits else 0
        return LiveFigures(peak, logits_at_peak, logits_peak, others_peak, allocations)


def _vocabulary_inputs(op_fields, vocab_size: int):
    """Allocation ids of an operator's tensor inputs whose last dimension is the vocabulary."""
    for value in getattr(op_fields, "inputs", ()):
        sizes = getattr(value, "sizes", None)
        if sizes and len(sizes) >= 2 and sizes[-1] == vocab_size:
            yield value.allocation_id


def vocabulary_size(model) -> Optional[int]:
    """Rows of the model's output embedding (the LM head), or its config's vocab_size; None if neither."""
    if model is None:
        return None
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if getter is not None and not isinstance(module, torch.nn.Linear):
            try:
                out = getter()
            except (AttributeError, NotImplementedError):
                out = None
            weight = getattr(out, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                return int(weight.shape[0])
        size = getattr(getattr(module, "config", None), "vocab_size", None)
        if isinstance(size, int):
            return size
    return None
