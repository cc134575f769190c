"""The memory recorder on CPU: exact tensor-counted components, the transient peak from the allocator's events,
GPU-only parts None with a reason."""

from __future__ import annotations

import mmap
from dataclasses import replace

import pytest
import torch

from foundation.settings import ModelArguments
from profiling import activations as A, components as C
from profiling.device import MemoryProbe, cuda_unavailable_reason, peak_bytes, read_nvml
from profiling.predict import EstimateArguments, forward_spec, resolve_shape
from profiling.recorder import MemoryRecorder
from profiling.tensors import count_tensors
from trainer.model.shared_base import AdapterSpec, build_shared_model

VOCAB = 512
GPU_PARTS = {C.OTHER_TENSORS, C.ALLOCATOR_OVERHEAD, C.CUDA_CONTEXT}


@pytest.fixture(scope="module", params=["none", "nf4"])
def sft_model(request):
    args = ModelArguments(model_name_or_path="tiny-llama", quantization=request.param, gradient_checkpointing=False,
                          lora_r=8, lora_alpha=16)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    model.train()
    return request.param, model


def batch(b=2, t=16):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def train_step(model, optimizer, recorder):
    ids, mask = batch()
    with recorder.phase("forward_backward"):
        model.logits(ids, mask, "policy").float().pow(2).mean().backward()
        recorder.sample()  # gradients exist now; zero_grad below frees them before the phase ends
        optimizer.zero_grad(set_to_none=True)
    with recorder.phase("optimizer_step"):
        for p in model.trainable_parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_phase_on_cpu_measures_the_transient_peak_and_reports_gpu_only_parts_as_none(sft_model):
    _, model = sft_model
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    recorder = MemoryRecorder("sft", model=model, optimizer=optimizer)
    train_step(model, optimizer, recorder)
    fb = recorder.records[("sft", "forward_backward")]
    assert fb.cuda is None
    assert "CUDA" in fb.gpu_reason and "\n" not in fb.gpu_reason
    assert {c for c, v in fb.components.items() if v is None} == GPU_PARTS
    assert set(recorder.needs_gpu()) == GPU_PARTS
    assert fb.components[C.ACTIVATIONS] > 0 and fb.components[C.LOGITS] > 0
    # tensor-counted parts are exact: counted here straight from the parameters, not by the walk it uses
    quantization, _ = sft_model
    trainable = sum(p.numel() for p in model.trainable_parameters())
    named = dict(model.named_parameters())
    lora = sum(p.numel() * p.element_size() for n, p in named.items() if ".lora_" in n and ".policy" in n)
    linears = sum(p.numel() * p.element_size() for n, p in named.items() if n.endswith("_proj.base_layer.weight"))
    other = sum(p.numel() * p.element_size() for n, p in named.items()
                if ".lora_" not in n and not n.endswith("_proj.base_layer.weight"))
    rotary = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    assert fb.components[C.adapter("policy")] == lora == 4 * trainable
    assert fb.components[C.BASE_OTHER] == other + rotary
    if quantization == "none":
        assert fb.components[C.BASE_WEIGHTS] == linears
    else:  # packed 4-bit: half a byte per weight
        shapes = [m.weight.quant_state.shape for m in model.modules() if type(m).__name__ == "Linear4bit"]
        assert fb.components[C.BASE_WEIGHTS] == sum((a * b + 1) // 2 for a, b in shapes) == linears
    assert fb.components[C.GRADIENTS] == 4 * trainable
    step = recorder.records[("sft", "optimizer_step")]
    assert step.components[C.OPTIMIZER_STATES] == 8 * trainable + 4 * len(model.trainable_parameters())
    assert step.components[C.OPTIMIZER_TEMPORARIES] == step.live.peak - step.live.logits_at_peak


def test_generate_s_transient_is_the_kv_cache_an_eager_decode_grows_else_activations(sft_model):
    """generate's transient peak is the KV cache an eager decode grows; where a compiled decode's full-length
    cache is held (counted from its tensors in every phase, as the estimator prices it) the peak beyond it is
    the prompt's forward and the steps' work: activations, the estimator's name for them."""
    from types import SimpleNamespace

    _, model = sft_model
    components = {}
    for held in ([], [torch.zeros(4096)]):
        recorder = MemoryRecorder("grpo", model=model)
        recorder.track(holder=SimpleNamespace(held=lambda: {C.KV_CACHE: held}, swapped_out=lambda: []))  # a decoder
        with recorder.phase("generate"):
            work = torch.ones(100_000)
            del work
        components[len(held)] = recorder.records[("grpo", "generate")].components
    assert components[0][C.KV_CACHE] >= 400_000 and C.ACTIVATIONS not in components[0]
    assert components[1][C.KV_CACHE] == 4 * 4096 and components[1][C.ACTIVATIONS] >= 400_000


def test_repeated_phase_keeps_its_largest_occurrence_and_counts_calls(sft_model):
    _, model = sft_model
    recorder = MemoryRecorder("ppo", model=model)
    small, large = torch.zeros(10), torch.zeros(1000)
    for buffer in (small, large, small):
        recorder.track(rollout_buffers=buffer)
        with recorder.phase("score"):
            pass
    record = recorder.records[("ppo", "score")]
    assert record.calls == 3
    assert record.components[C.ROLLOUT_BUFFERS] == 4000
    assert record.total == C.total(count_tensors(model).components()) + 4000


def test_disabled_recorder_records_and_writes_nothing(sft_model, tmp_path):
    _, model = sft_model
    recorder = MemoryRecorder("sft", model=model, enabled=False)
    with recorder.phase("forward_backward"):
        recorder.sample()
    assert recorder.records == {}
    assert recorder.write(tmp_path / "run") == {}
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dropout", [0.05, 0.0], ids=["lora dropout", "no lora dropout"])
def test_saved_for_backward_equals_the_activation_formula_exactly(sft_model, dropout):
    """With LoRA dropout each LoRA layer saves its own dropped input and mask; without it (PPO, GRPO), in
    fp32 the LoRA layers reading one tensor save it once, in bf16 each saves its own fp32 cast."""
    quantization, model = sft_model
    set_lora_dropout(model, dropout)
    recorder = MemoryRecorder("sft", model=model)
    b, t = 2, 24
    ids, mask = batch(b, t)
    with recorder.phase("forward", count_saved=True):
        logits = model.logits(ids, mask, "policy")
    measured = recorder.records[("sft", "forward")].saved_for_backward
    args = EstimateArguments(model_name_or_path="tiny-llama", stage="sft", quantization=quantization, dtype="float32",
                             lora_r=8, device="cpu", vocab_size=VOCAB, lora_dropout=dropout)
    spec = forward_spec(args, 2 if quantization == "nf4" else 4)
    assert measured == A.saved_for_backward(resolve_shape(args), spec, b * t, t)
    del logits
    set_lora_dropout(model, 0.05)


@pytest.mark.parametrize("dropout", [0.05, 0.0], ids=["lora dropout", "no lora dropout"])
def test_saved_for_backward_under_bf16_autocast_equals_the_formula_exactly(dropout):
    """Under autocast (a GPU's mixed precision; the CPU's bf16 autocast casts the same matmuls) each LoRA layer
    saves the bf16 cast of its fp32 input, not the fp32 one, and the LoRA weights' bf16 casts."""
    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", dtype="bfloat16",
                          gradient_checkpointing=False, lora_r=8, lora_alpha=16)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    set_lora_dropout(model, dropout)
    recorder = MemoryRecorder("sft", model=model)
    b, t = 2, 24
    ids, mask = batch(b, t)
    with recorder.phase("forward", count_saved=True), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.logits(ids, mask, "policy")
    measured = recorder.records[("sft", "forward")].saved_for_backward
    estimate = EstimateArguments(model_name_or_path="tiny-llama", stage="sft", quantization="none", dtype="bfloat16",
                                 lora_r=8, device="cpu", vocab_size=VOCAB, lora_dropout=dropout,
                                 mixed_precision="bf16")
    spec = forward_spec(estimate.resolved(), 2)
    without = forward_spec(replace(estimate, mixed_precision="no").resolved(), 2)
    assert measured == A.saved_for_backward(resolve_shape(estimate), spec, b * t, t)
    assert measured < A.saved_for_backward(resolve_shape(estimate), without, b * t, t)
    del logits


def set_lora_dropout(model, p: float) -> None:
    """Each LoRA layer's dropout as a stage builds it: nn.Dropout(p), or nn.Identity when p is 0 (peft's)."""
    for layer in model._tuner_layers:
        for name in layer.lora_dropout:
            layer.lora_dropout[name] = torch.nn.Dropout(p) if p else torch.nn.Identity()
    model.train()


def test_device_readers_give_reasons_instead_of_raising_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cuda_unavailable_reason() is not None
    reading = read_nvml()
    assert reading.used is None and reading.total is None
    assert reading.reason and "\n" not in reading.reason


def test_cuda_attribution_arithmetic_with_given_allocator_figures(sft_model, monkeypatch):
    """The CUDA branch's bookkeeping, fed fixed allocator/NVML figures (no GPU here to read them from):
    resident untracked bytes, the phase peak less what counted tensors grew by, reserved minus
    allocated, and NVML's used minus reserved."""
    from profiling import device as D

    _, model = sft_model
    recorder = MemoryRecorder("sft", model=model)
    recorder.gpu_reason = None
    static = C.total(count_tensors(model).components())
    trainable = 4 * sum(p.numel() for p in model.trainable_parameters())
    before = static + 1_000
    peak = before + trainable + 50_000
    monkeypatch.setattr(D, "begin_phase", lambda device: before)
    monkeypatch.setattr(D, "read_allocator", lambda device: D.AllocatorSample(
        allocated=before, reserved=peak + 4_096, peak_allocated=peak, peak_reserved=peak + 2_048))
    monkeypatch.setattr(D, "read_nvml", lambda device: D.NvmlReading(peak + 4_096 + 300_000_000, 80 * 2**30, "x", None))
    ids, mask = batch()
    with recorder.phase("forward_backward"):
        model.logits(ids, mask, "policy").float().pow(2).mean().backward()
        recorder.sample()
        model.zero_grad(set_to_none=True)
    record = recorder.records[("sft", "forward_backward")]
    assert record.components[C.OTHER_TENSORS] == 1_000
    assert record.components[C.GRADIENTS] == trainable
    assert record.components[C.ACTIVATIONS] == 50_000
    assert record.components[C.ALLOCATOR_OVERHEAD] == 2_048
    assert record.components[C.CUDA_CONTEXT] == 300_000_000
    assert record.cuda.peak_above_entry == trainable + 50_000


def test_nested_phases_are_each_recorded_and_the_outer_keeps_the_inner_peak(sft_model, monkeypatch):
    """PPO's update holds its optimizer steps: both phases are recorded, and the reset of the allocator's
    peak statistics at the inner phase's start does not lose the outer phase's peak."""
    from profiling import device as D

    _, model = sft_model
    recorder = MemoryRecorder("ppo", model=model)
    recorder.gpu_reason = None
    peaks = iter([500, 900, 300, 400])  # outer so far, inner, after the inner (since its reset), outer at exit
    allocated = {"now": 100}
    monkeypatch.setattr(D, "begin_phase", lambda device: allocated["now"])

    def reading(device):
        peak = next(peaks)
        return D.AllocatorSample(allocated=allocated["now"], reserved=peak, peak_allocated=peak, peak_reserved=peak)

    monkeypatch.setattr(D, "read_allocator", reading)
    monkeypatch.setattr(D, "read_nvml", lambda device: D.NvmlReading(None, None, None, "none"))
    with recorder.phase("update"):
        with recorder.phase("optimizer_step"):
            pass
    inner, outer = recorder.records[("ppo", "optimizer_step")], recorder.records[("ppo", "update")]
    assert inner.cuda.peak_allocated == 900
    assert outer.cuda.peak_allocated == 900  # not the 400 read after the inner phase's reset
    assert recorder._open == []


def test_metering_saved_tensors_frees_a_graph_that_is_never_run_backward():
    """A metric computed with grad and then detached (PPO's entropy without an entropy bonus) leaves a
    graph nobody runs backward: once its output is dropped, what it saved must go too, metered or not."""
    import gc
    import weakref

    from profiling.saved import SavedTensorMeter

    x = torch.randn(64, 64, requires_grad=True)
    meter = SavedTensorMeter()
    with meter.watch():
        out = (x * 2).exp()  # exp saves its own output
    alive = weakref.ref(out)
    metric = out.sum().detach()
    del out
    gc.collect()
    assert meter.bytes == 64 * 64 * 4 and metric.item() > 0
    assert alive() is None, "the meter kept a saved output alive through its own grad_fn"


def test_the_memory_probe_gives_each_cpu_phase_its_own_resident_peak():
    """On CPU the peak is the resident set's, reset at each phase boundary: a phase after one that held 256 MiB
    reads a peak well below it, and the lifetime reader (the trainer's perf/peak_rss_gb) says "rss"."""
    probe = MemoryProbe(torch.device("cpu"))
    if not probe.rss_resettable:
        pytest.skip("this kernel does not let a process reset its peak resident set")
    probe.reset()
    # fresh pages of their own, each written so it is resident: a malloc'd buffer could reuse resident pages the
    # process freed earlier, and leave the resident set as it was
    held = mmap.mmap(-1, 256 << 20)
    for page in range(0, len(held), mmap.PAGESIZE):
        held[page] = 1
    first = probe.peak()["peak_rss_bytes"]
    held.close()
    probe.reset()
    second = probe.peak()["peak_rss_bytes"]
    assert first - second > 200 << 20
    assert probe.peak()["peak_allocated_bytes"] is None and probe.now()["rss_bytes"] > 0
    assert peak_bytes(torch.device("cpu"))[1] == "rss"
