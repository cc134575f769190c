"""The transient peak of a phase on the CPU, read off the allocator's events (profiling/live.py)."""

from __future__ import annotations

import torch

from profiling import components as C
from profiling.live import LiveTimeline
from profiling.recorder import MemoryRecorder

MIB = 2**20


def test_known_allocations_in_a_phase_give_their_exact_peak_and_logits():
    recorder = MemoryRecorder("sft", vocab_size=1000)
    kept = torch.zeros(1)  # resident before the phase: not in its peak, even when freed inside it
    with recorder.phase("forward_backward"):
        del kept
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del a
        c = torch.empty(3 * MIB, dtype=torch.uint8)  # b + c: the peak, 5 MiB
        del b, c
        logits = torch.empty(8, 1000)  # read by an operator with the vocabulary last: logits
        logits.exp_()
        del logits
    record = recorder.records[("sft", "forward_backward")]
    assert record.live.peak == 5 * MIB
    assert record.live.logits_peak == 8 * 1000 * 4 and record.live.logits_at_peak == 0
    assert record.live.others_peak == 5 * MIB
    assert record.components[C.ACTIVATIONS] == 5 * MIB and record.components[C.LOGITS] == 0


def test_tensors_the_walk_counts_are_left_out_of_the_peak_from_their_allocation():
    """A tensor made inside the phase and tracked (here a rollout buffer; gradients and optimizer states
    alike) is its own component: the transient peak leaves it out, also before the walk saw it."""
    recorder = MemoryRecorder("ppo", vocab_size=1000)
    with recorder.phase("score"):
        buffer = torch.empty(4 * MIB, dtype=torch.uint8)
        temporary = torch.empty(MIB, dtype=torch.uint8)
        del temporary
        recorder.track(rollout_buffers=[buffer])
        recorder.sample()
    record = recorder.records[("ppo", "score")]
    assert record.live.peak == MIB
    assert record.components[C.ROLLOUT_BUFFERS] == 4 * MIB


def test_nested_phases_each_get_their_peak_and_the_outer_includes_the_inner():
    recorder = MemoryRecorder("ppo", vocab_size=1000)
    with recorder.phase("update"):
        x = torch.empty(2 * MIB, dtype=torch.uint8)
        with recorder.phase("optimizer_step"):
            y = torch.empty(3 * MIB, dtype=torch.uint8)
            del y
        del x
    assert recorder.records[("ppo", "optimizer_step")].live.peak == 3 * MIB
    assert recorder.records[("ppo", "update")].live.peak == 5 * MIB
    assert recorder.records[("ppo", "optimizer_step")].components[C.OPTIMIZER_TEMPORARIES] == 3 * MIB


def test_a_phase_whose_timeline_cannot_start_reports_none_instead_of_a_figure(monkeypatch):
    monkeypatch.setattr(LiveTimeline, "start", lambda self: False)  # as when another profiler holds the thread
    recorder = MemoryRecorder("sft", vocab_size=1000)
    with recorder.phase("forward_backward"):
        torch.empty(MIB, dtype=torch.uint8)
    record = recorder.records[("sft", "forward_backward")]
    assert record.live is None and record.components[C.ACTIVATIONS] is None
    assert C.ACTIVATIONS in recorder.needs_gpu()


def test_the_timeline_replays_frees_of_its_own_allocations_only():
    timeline = LiveTimeline()
    before = torch.empty(MIB, dtype=torch.uint8)
    assert timeline.start()
    start = timeline.mark()
    del before  # allocated before the timeline: its free is not in any sum
    inside = torch.empty(2 * MIB, dtype=torch.uint8)
    end = timeline.mark()
    timeline.stop()
    figures = timeline.figures(start, end, {end: {inside.untyped_storage().data_ptr()}})
    assert (figures.peak, figures.allocations) == (0, 1)  # the walk at `end` claimed it
    assert timeline.figures(start, end, {}).peak == 2 * MIB
