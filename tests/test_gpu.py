"""What only a GPU can check: bitsandbytes' CUDA kernels, paged optimizer states, adapter isolation on
CUDA, and the recorder's allocator and NVML readings. Marked `gpu`: they skip on a machine without
CUDA (CI) and run in the GPU kit's `check` part (`benchmarks/gpu/run.sh check`: `pytest -m gpu`).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import adapter_state

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU kit runs these)")]

VOCAB = 512


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def tiny_args(**kw):
    from foundation.settings import ModelArguments

    values = dict(model_name_or_path="tiny-llama", quantization="nf4", gradient_checkpointing=True, lora_r=8,
                  lora_alpha=16, lora_dropout=0.0, preset_overrides="hidden_size=256,intermediate_size=704")
    values.update(kw)
    return ModelArguments(**values)


def assert_same_greedy(got, want, atol: float) -> None:
    """Two greedy decodes of the same rows by differently fused kernels agree: in each row the tokens up to
    the first that differs, the log-probs before it and the entropies up to it (same prefix, same
    distribution) within `atol`; at that token each path took its own maximum, so the two picks' log-probs
    tie within `atol`. A random tiny model's top tokens lie closer than bf16 rounding, so such a tie can
    happen; a wrong pass moves every distribution and fails all three."""
    for row in range(want.tokens.shape[0]):
        differ = (got.tokens[row] != want.tokens[row]).nonzero()
        first = int(differ[0]) if len(differ) else want.tokens.shape[1]
        close = dict(rtol=0, atol=atol, msg=lambda m: f"row {row}, first differing token {first}: {m}")
        torch.testing.assert_close(got.logprobs[row, :first + 1], want.logprobs[row, :first + 1], **close)
        torch.testing.assert_close(got.entropy[row, :first + 1], want.entropy[row, :first + 1], **close)


def test_nf4_linear_forward_and_backward_on_cuda_match_bf16():
    """bitsandbytes' 4-bit matmul against the same weights dequantized, in bf16: outputs and input
    gradients agree to NF4's rounding of the weights (compared with the dequantized weights: exact maths)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 4096, bias=False, dtype=torch.bfloat16, device="cuda")
    q = bnb.nn.Linear4bit(1024, 4096, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                          compress_statistics=True, device="meta")
    q.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                 compress_statistics=True, module=q).to("cuda")
    dequantized = F.dequantize_4bit(q.weight.data, q.weight.quant_state).to(torch.bfloat16)
    x1 = torch.randn(8, 16, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y_q, y_ref = q(x1), x2 @ dequantized.t()
    torch.testing.assert_close(y_q, y_ref, rtol=2e-2, atol=2e-2)
    probe = torch.randn_like(y_ref)  # a sum against fixed random weights: input gradients of order one
    (y_q.float() * probe).sum().backward()
    (y_ref.float() * probe).sum().backward()
    assert x2.grad.abs().mean() > 0.1
    relative = (x1.grad.float() - x2.grad.float()).norm() / x2.grad.float().norm()
    assert relative < 2e-2, relative
    # and the 4-bit weights are close to the original ones (NF4 rounding: a few percent of their scale)
    error = (dequantized.float() - dense.weight.float()).abs().mean() / dense.weight.float().abs().mean()
    assert error < 0.15, error


def test_paged_8bit_adamw_steps_on_cuda_with_8bit_states():
    from trainer.engine.optim import build_optimizer

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096, 64, device="cuda"))
    before = p.detach().clone()
    opt = build_optimizer([p], "paged_adamw_8bit", 1e-3, 0.0, cuda())
    assert type(opt).__name__ == "PagedAdamW8bit"
    p.grad = torch.randn_like(p)
    opt.step()
    assert not torch.equal(p.detach(), before)
    state = opt.state[p]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8  # 8-bit moments


def test_a_ppo_step_on_cuda_moves_only_policy_value_and_value_head(tmp_path):
    """Adapter isolation on CUDA with NF4 and gradient checkpointing: after a PPO update the base, the
    reference and reward adapters and the reward head are bit-for-bit what they were."""
    from conftest import saved_head

    from foundation.settings import PPOArguments, TrainArguments
    from trainer.engine.harness import Engine
    from trainer.engine.launch import make_accelerator
    from trainer.engine.phases import watching
    from trainer.model.decode import Generator
    from trainer.model.shared_base import build_shared_model, stage_specs
    from trainer.rl.algorithms.ppo import PPO
    from trainer.rl.online import rl_step
    from trainer.rl.rewards import Scorer

    train_args = TrainArguments(output_dir=str(tmp_path), micro_batch_size=2, learning_rate=1e-2, warmup_steps=0,
                                report_to="none")
    accelerator = make_accelerator(train_args)
    specs = stage_specs("ppo", {})
    specs[-1].head_from = saved_head(tmp_path / "reward-head", 256)
    model = build_shared_model(tiny_args(), specs, vocab_size=VOCAB, device=cuda())
    before = {name: adapter_state(model, name) for name in model.adapter_names}
    base = {n: p.detach().clone() for n, p in model.peft.named_parameters() if "lora_" not in n}
    engine = Engine(model, train_args, accelerator, "ppo")
    args = PPOArguments(scripted_reward=None, rollout_batch_size=4, rollout_micro_batch_size=4, mini_batch_size=2,
                        max_new_tokens=6, min_new_tokens=6)
    algorithm = PPO(args)
    state = algorithm.start(2, 0)
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with watching(engine.recorder.phase):
        result = rl_step(engine, Generator(model), batch, algorithm, state, Scorer(), eos_id=2, pad_id=0)
    assert result.stepped and all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values())
    after = {name: adapter_state(model, name) for name in model.adapter_names}
    for name in ("reference", "reward"):
        assert all(torch.equal(before[name][k], after[name][k]) for k in before[name]), name
    assert any(not torch.equal(before["policy"][k], after["policy"][k]) for k in before["policy"])
    assert any(k.startswith("head.") and not torch.equal(before["value"][k], after["value"][k]) for k in before["value"])
    for n, p in model.peft.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_old_logprobs_read_while_sampling_on_cuda_equal_a_policy_scoring_pass(tmp_path, decode):
    """The sampled tokens' log-probs read from the decode's own logits match a policy scoring pass on CUDA
    with NF4, also from a compiled decode step run as CUDA graphs (reduce-overhead mode), whose outputs the
    next replay overwrites: the loop copies each step's token, log-prob and entropy out first; a second
    rollout replays the graphs the first recorded, with the same tokens as the eager loop."""
    from conftest import saved_head

    from foundation.settings import RolloutArguments
    from trainer.model.shared_base import build_shared_model, stage_specs
    from trainer.rl.rewards import Scorer
    from trainer.rl.rollout import make_rollout
    from trainer.rl.scoring import response_logprobs

    specs = stage_specs("ppo", {})
    specs[-1].head_from = saved_head(tmp_path / "reward-head", 256)
    model = build_shared_model(tiny_args(), specs, vocab_size=VOCAB, device=cuda())
    model.eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    from trainer.model.decode import Generator, Sampling

    args = RolloutArguments(max_new_tokens=8, min_new_tokens=8, temperature=0.7, rollout_micro_batch_size=4)
    generator = Generator(model, decode)

    def rollout():
        torch.manual_seed(0)
        return make_rollout(generator, ids, torch.ones_like(ids), args, Scorer(), eos_id=2, pad_id=0, value=True)

    rollout()  # the compiled path compiles and records its graphs on its first call
    sampled = rollout()
    assert (generator.compiled is not None) == (decode == "compiled")
    greedy = [g.sample(ids, torch.ones_like(ids), Sampling(max_new_tokens=8, temperature=0), eos_id=2, pad_id=0)
              for g in (Generator(model), generator)]
    assert_same_greedy(greedy[1], greedy[0], atol=2e-2)
    with torch.no_grad():
        scored, entropy = response_logprobs(model, sampled.input_ids, sampled.attention_mask, sampled.response_length,
                                            "policy", 0.7, with_entropy=True)
    mask = sampled.response_mask
    # bf16 compute: a decode step and a whole-sequence pass differ by bf16 rounding, not more
    torch.testing.assert_close(sampled.logprobs, scored.float() * mask, rtol=0, atol=5e-2)
    torch.testing.assert_close(sampled.entropy, entropy.float() * mask, rtol=0, atol=5e-2)


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_a_dense_copy_of_the_nf4_weights_decodes_as_the_4bit_layers_do_on_cuda(decode):
    """--generation_weights on CUDA: a dense copy multiplies the values bitsandbytes' 4-bit matmul multiplies
    where it dequantizes the NF4 weight (past 1536 rows, on any GPU; for fewer it picks fused kernels per
    architecture, which sum in another order), so decoding 4 rows from it gives the tokens of decoding from
    the NF4 weights and their log-probs to bf16 rounding; a resident copy serves the next rollout, compiled
    as CUDA graphs, and the model holds its 4-bit layers again after each."""
    from bitsandbytes.nn import Linear4bit

    from trainer.model.decode import Generator, Sampling
    from trainer.model.decode_weights import DequantizedLinear
    from trainer.model.shared_base import build_shared_model, stage_specs

    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    mask = torch.ones_like(ids)
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    runs, generators = {}, {w: Generator(model, decode, w) for w in ("quantized", "dequantized", "resident")}
    for weights in ("quantized", "dequantized", "resident", "resident"):
        torch.manual_seed(0)
        runs.setdefault(weights, []).append(generators[weights].sample(ids, mask, Sampling(
            max_new_tokens=8, min_new_tokens=8, temperature=0.7), 2, 0))
        assert [m for m in model.modules() if isinstance(m, Linear4bit)] == layers
    generators["resident"].release()
    want = runs["quantized"][0]
    for got in (runs["dequantized"][0], *runs["resident"]):
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-2)
    for got in runs["resident"]:  # the same values in a copy made once or per rollout
        torch.testing.assert_close(got.logprobs, runs["dequantized"][0].logprobs, rtol=0, atol=1e-5)
    x = torch.randn(2048, layers[0].in_features, device=cuda(), dtype=torch.bfloat16, requires_grad=True)
    assert torch.equal(DequantizedLinear(layers[0])(x), layers[0](x))  # bitsandbytes: dequantize, F.linear


def test_on_cuda_under_autocast_the_dense_copy_s_lora_a_rows_decode_as_a_matmul_of_their_own(monkeypatch):
    """The run's bf16 autocast, a resident dense copy with the policy's LoRA-A rows (one matmul per LoRA layer
    and token for the base and LoRA-A products), decoded compiled as CUDA graphs twice (the rows refreshed in
    place between rollouts, the policy moved in between): what an eager decode gives with the LoRA-A
    products from their own matmul (`assert_same_greedy`; one compilation, for the `check` part's time)."""
    from conftest import dense_copies_made

    import trainer.model.decode_weights as decode_module
    from trainer.model.decode import Generator, Sampling
    from trainer.model.shared_base import build_shared_model, stage_specs

    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())

    def rollouts(decode: str):
        sampling = Sampling(max_new_tokens=8, min_new_tokens=8, temperature=0)
        generator, out = Generator(model, decode, "resident"), []
        for shift in (0.0, 0.05):
            with torch.no_grad():  # B != 0, then the policy after an update
                for p in model.trainable_parameters():
                    p.normal_(shift, 0.05, generator=torch.Generator(cuda()).manual_seed(p.numel()))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out.append(generator.sample(ids, torch.ones_like(ids), sampling, 2, 0))
        generator.release()
        return out

    made = dense_copies_made(monkeypatch)
    fused = rollouts("compiled")
    assert made and all(m.lora_rank == 8 and m.rows_for is None for m in made)
    monkeypatch.setattr(decode_module, "_rows_for", lambda *a: 0)
    apart = rollouts("eager")
    for got, want in zip(fused, apart):
        assert_same_greedy(got, want, atol=2e-2)
    assert not torch.equal(fused[0].tokens, fused[1].tokens) or not torch.equal(fused[0].logprobs, fused[1].logprobs)


@pytest.mark.parametrize("weights", ["quantized", "resident"])
def test_the_compiled_step_compiles_its_layers_as_one_region_on_cuda_as_the_whole_step_decodes(weights):
    """On CUDA (CUDA graphs, NF4 or its dense copy) the decoder layers compile as one reused region without
    falling back to the whole step, and decode what the whole step decodes (`assert_same_greedy`). From the
    dense copy, where torch reuses traced regions, dynamo traces one layer for all of them."""
    import importlib.util

    from torch._dynamo.utils import compilation_time_metrics as timers

    from trainer.model.decode import Generator, Sampling
    from trainer.model.shared_base import build_shared_model, stage_specs

    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    sampling = Sampling(max_new_tokens=8, temperature=0)
    generator = Generator(model, "compiled", weights)
    traced = len(timers.get("invoke_subgraph_trace", []))
    regions = generator.sample(ids, torch.ones_like(ids), sampling, eos_id=2, pad_id=0)
    assert generator.compiled.regions.count == len(model.causal_lm.model.layers) > 1
    if weights == "resident" and importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph"):
        assert len(timers.get("invoke_subgraph_trace", [])) - traced == 1
    generator.compile_anew(regions=False)
    whole = generator.sample(ids, torch.ones_like(ids), sampling, eos_id=2, pad_id=0)
    generator.release()
    assert_same_greedy(regions, whole, atol=2e-2)


def test_on_cuda_the_compiled_step_serves_the_steps_before_and_after_min_new_tokens_as_one_graph():
    """EOS barred for 3 of 6 tokens: the compiled step (CUDA graphs) compiles once, its bar a tensor copied in
    per replay, and decodes the eager loop's tokens (`assert_same_greedy`), none of the first 3 EOS. The model
    is checkpointed, as a stage's is: no graph break either (transformers' input hook broke it into 3 graphs
    under torch 2.11). Dynamo is reset first: past its recompile limit the frames around a break, the model
    classes' that earlier tests compiled, would run eagerly and hide the graphs a break makes."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from trainer.model.decode import Generator, Sampling
    from trainer.model.shared_base import build_shared_model, stage_specs

    torch._dynamo.reset()
    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    greedy = Sampling(max_new_tokens=6, min_new_tokens=3, temperature=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eos = int(Generator(model).sample(ids, torch.ones_like(ids), Sampling(max_new_tokens=1, temperature=0), 0, 0)
                  .tokens[0, 0])  # row 0's first greedy token: barred, the rows must pick another
        eager = Generator(model).sample(ids, torch.ones_like(ids), greedy, eos, 0)
        generator = Generator(model, "compiled")
        generator.compile_anew()
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        compiled = generator.sample(ids, torch.ones_like(ids), greedy, eos, 0)
    assert all(layer.gradient_checkpointing for layer in model.causal_lm.model.layers)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks
    assert (compiled.tokens[:, :3] != eos).all()
    assert_same_greedy(compiled, eager, atol=2e-2)


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_under_bf16_autocast_on_cuda_the_lora_copies_decode_the_tokens_autocast_s_casts_give(decode, monkeypatch):
    """A rollout on CUDA runs under the run's bf16 autocast: the decode multiplies bf16 copies of the policy's
    LoRA weights (kept for the compiled step's CUDA graphs; the LoRA-A ones as rows of the dense copy, whose
    one matmul sums in another order than a matmul of their own) and samples the tokens autocast's per-step
    casts give, their log-probs to bf16 rounding."""
    from contextlib import nullcontext

    from trainer.model.decode import Generator, Sampling
    from trainer.model.decode_weights import DecodeWeights
    from trainer.model.shared_base import build_shared_model, stage_specs

    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    sampling, generator = Sampling(max_new_tokens=8, temperature=0), Generator(model, decode, "resident")

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return generator.sample(ids, torch.ones_like(ids), sampling, eos_id=2, pad_id=0)

    got = run()
    assert bool(generator.weights.lora) == (decode == "compiled")  # kept for the compiled step's CUDA graphs
    with monkeypatch.context() as patch:
        patch.setattr(DecodeWeights, "lora_copies", lambda *args, **kwargs: nullcontext())
        want = run()
    generator.release()
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-2)


def test_the_recorder_fills_its_cuda_allocator_and_nvml_fields():
    from profiling import components as C
    from profiling.recorder import MemoryRecorder
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB, device=cuda())
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    recorder = MemoryRecorder("sft", model=model, optimizer=optimizer, device=cuda())
    ids = torch.randint(0, VOCAB, (4, 64), device="cuda")
    with recorder.phase("forward_backward"):
        model.logits(ids, torch.ones_like(ids), "policy").float().pow(2).mean().backward()
        recorder.sample()
    record = recorder.records[("sft", "forward_backward")]
    assert record.gpu_reason is None and record.cuda is not None
    assert record.cuda.peak_allocated > record.cuda.allocated_before > 0
    assert record.cuda.nvml_used is not None and record.cuda.nvml_total > record.cuda.nvml_used > 0
    assert record.components[C.ACTIVATIONS] > 0 and record.components[C.CUDA_CONTEXT] is not None
    assert recorder.needs_gpu() == []


def test_the_simulated_card_caps_the_allocator():
    """--simulate_gpu_gib: the allocator gets the card less what CUDA holds outside it (the context measured at
    start, the kernels assumed to load later); an allocation above that fails although the real card has room,
    one below it does not."""
    from trainer.engine.budget import outside_allocator_gib
    from trainer.engine.setup import simulate_gpu_memory

    total = torch.cuda.get_device_properties(cuda()).total_memory
    outside, _ = outside_allocator_gib(cuda())
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(cuda())  # what earlier tests keep
    card = math.ceil(held / 2**30 + outside) + 2  # a card with about 2 GiB free for the allocator
    simulate_gpu_memory(card, cuda())
    try:
        room = (card - outside) * 2**30 - held
        kept = torch.empty(int(room - 2**28), dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**30, dtype=torch.uint8, device="cuda")
        assert total > (card + 2) * 2**30 and kept.numel() > 0  # the card itself had room
    finally:
        kept = None
        torch.cuda.set_per_process_memory_fraction(1.0, cuda())
        torch.cuda.empty_cache()


def test_fp16_loss_scaling_skips_an_overflow_step_and_trains_on(tmp_path):
    """fp16 AMP: a step with an inf gradient is skipped by the scaler (not counted as bad), the scale comes
    down, and the next step runs (the scaler must see every step, or unscale_ fails the next one)."""
    from foundation.settings import TrainArguments
    from trainer.engine.harness import Engine
    from trainer.engine.launch import make_accelerator, reset_accelerate
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    args = TrainArguments(output_dir=str(tmp_path), mixed_precision="fp16", report_to="none", optimizer="adamw_torch")
    reset_accelerate()  # an earlier test in this process made a bf16 Accelerator
    accelerator = make_accelerator(args)
    model = build_shared_model(tiny_args(quantization="none", dtype="float32"), [AdapterSpec("policy", trainable=True)],
                               vocab_size=VOCAB, device=cuda())
    engine = Engine(model, args, accelerator, "sft")
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    scale = accelerator.scaler.get_scale()
    with accelerator.autocast():
        loss = engine.model(ids, torch.ones_like(ids), adapter="policy").float().mean()
    engine.backward(loss)
    for p in engine.params:
        if p.grad is not None:
            p.grad.fill_(float("inf"))
    stepped, sound, _ = engine.optimizer_step(True)
    assert (stepped, sound) == (False, True) and accelerator.scaler.get_scale() < scale
    with accelerator.autocast():
        loss = engine.model(ids, torch.ones_like(ids), adapter="policy").float().mean()
    engine.backward(loss)
    stepped, sound, norm = engine.optimizer_step(True)
    assert stepped and sound and norm == norm


def test_offloaded_activations_on_cuda_lower_the_peak_by_the_kept_inputs_and_keep_the_gradients():
    """--offload_activations on CUDA: every input checkpointing keeps goes to the host (each layer's, the
    final norm's), and a checkpointed training pass's peak allocated drops by about the other layers' inputs:
    the peak is the first layer the backward recomputes, by which time the final norm's input is freed in both
    passes and that layer's own input is back on the card. The gradients agree with the pass that kept them
    to bf16 rounding (the attention's backward on CUDA sums in no fixed order, so two runs differ that much
    anyway; an input brought back wrong would be off by its whole size)."""
    from trainer.model.offload import SavedToHost
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    args = tiny_args(preset_overrides="hidden_size=1024,intermediate_size=2816,num_hidden_layers=8")
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB, device=cuda()).train()
    b, t, h, layers = 8, 512, 1024, 8
    ids = torch.randint(0, VOCAB, (b, t), device=cuda(), generator=torch.Generator(cuda()).manual_seed(0))

    def run(hooks):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, torch.ones_like(ids), adapter="policy", output="logprobs", labels=ids).sum()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, [p.grad.float().clone() for p in model.trainable_parameters()]

    kept_peak, kept_grads = run(torch.enable_grad())
    offloader = SavedToHost(model.parameters())
    moved_peak, moved_grads = run(offloader.hooks())
    inputs = b * t * (layers * 2 * h + 4 * h + 4)  # bf16 layer inputs, the final norm's fp32 input and rsqrt
    assert offloader.bytes >= inputs
    assert kept_peak - moved_peak > 0.8 * (layers - 1) * b * t * 2 * h, (kept_peak, moved_peak)
    assert any(y.norm() > 0 for y in kept_grads)
    for x, y in zip(kept_grads, moved_grads):
        assert (x - y).norm() <= 1e-2 * y.norm(), ((x - y).norm(), y.norm())


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_on_cuda_a_grouped_query_model_decodes_with_its_heads_folded_as_with_repeated_kv_heads(decode, monkeypatch):
    """tiny-llama's 4 query heads on 2 KV heads, NF4, CUDA (graphs when compiled): each step's query heads
    folded onto their KV heads decode what transformers' sdpa, repeating the KV heads, decodes."""
    from contextlib import nullcontext

    from trainer.model import decode as module
    from trainer.model.shared_base import build_shared_model, stage_specs

    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    assert model.causal_lm.config.num_key_value_heads < model.causal_lm.config.num_attention_heads
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    sampling = module.Sampling(max_new_tokens=8, temperature=0)

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return module.Generator(model, decode).sample(ids, torch.ones_like(ids), sampling, eos_id=2, pad_id=0)

    folded = run()
    with monkeypatch.context() as patch:
        patch.setattr(module, "decode_attention", lambda causal_lm: nullcontext())
        repeated = run()
    assert_same_greedy(folded, repeated, atol=2e-2)


def test_on_cuda_in_bf16_single_token_attention_folded_onto_kv_heads_equals_sdpa_over_repeated_kv_heads():
    """The folded attention itself on CUDA in bf16 (7 query heads per KV head, as Qwen2.5-7B), a boolean
    mask shared by the heads: sdpa over the KV heads repeated gives the same output to bf16 rounding."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from trainer.model.attention import single_token_gqa

    g = torch.Generator(cuda()).manual_seed(0)
    query = torch.randn(8, 28, 1, 128, device=cuda(), dtype=torch.bfloat16, generator=g)
    key, value = (torch.randn(8, 4, 512, 128, device=cuda(), dtype=torch.bfloat16, generator=g) for _ in range(2))
    mask = torch.rand(8, 1, 1, 512, device=cuda(), generator=g) > 0.4
    got, _ = single_token_gqa(SimpleNamespace(num_key_value_groups=7, training=False), query, key, value, mask,
                              scaling=128 ** -0.5)
    want = F.scaled_dot_product_attention(query, key.repeat_interleave(7, dim=1), value.repeat_interleave(7, dim=1),
                                          attn_mask=mask, scale=128 ** -0.5).transpose(1, 2)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
    wrong = single_token_gqa(SimpleNamespace(num_key_value_groups=7, training=False), query.flip(1), key, value, mask,
                             scaling=128 ** -0.5)[0]
    assert (wrong.float() - want.float()).abs().max() > 0.05  # the comparison tells heads on the wrong KV head


def test_on_cuda_nf4_decoder_layers_compile_with_their_checkpoint_and_train_as_the_eager_ones(monkeypatch):
    """--compile_layers on CUDA with NF4 and bf16 autocast, the way the update runs: a routed training pass
    (policy logits and value scores) goes through every decoder layer compiled whole with its checkpoint (no
    fallback), and gives the eager pass's outputs and LoRA gradients to bf16 rounding."""
    from conftest import compiled_calls

    from trainer.model.compiled import compile_layers
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    specs = [AdapterSpec("policy", trainable=True), AdapterSpec("value", trainable=True, head=True)]
    model = build_shared_model(tiny_args(), specs, vocab_size=VOCAB, device=cuda()).train()
    with torch.no_grad():  # B != 0: the adapters act
        for p in model.trainable_parameters():
            p.normal_(0, 0.05, generator=torch.Generator(cuda()).manual_seed(p.numel()))
    ids = torch.randint(3, VOCAB, (4, 32), device=cuda(), generator=torch.Generator(cuda()).manual_seed(0))

    def train_pass():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, scores = model(ids, torch.ones_like(ids), adapter=("policy", "value"), output=("logits", "scores"),
                                   keep_last=16)
            loss = logits.float().log_softmax(-1).mean() + scores.float().pow(2).mean()
        loss.backward()
        return [logits.float(), scores.float()], [p.grad.float().clone() for p in model.trainable_parameters()
                                                  if p.grad is not None]

    eager = train_pass()
    layers = len(model.causal_lm.model.layers)
    assert compile_layers(model.causal_lm) == layers
    with compiled_calls(monkeypatch) as calls:
        train_pass()  # compiles
        compiled = train_pass()
    assert len(calls) == 2 * layers and len(compiled[1]) == len(eager[1]) > 0
    assert all(m.forward.whole for m in model.modules() if hasattr(m.forward, "whole"))
    for got, want in zip([*compiled[0], *compiled[1]], [*eager[0], *eager[1]], strict=True):
        assert want.abs().max() > 0
        assert (got - want).norm() <= 2e-2 * want.norm(), ((got - want).norm(), want.norm())


def test_on_cuda_a_per_rollout_copy_that_lies_elsewhere_is_decoded_from_where_it_lies(caplog, monkeypatch):
    """A per-rollout dense copy made while the last one is still held, so at other addresses: the compiled
    step's CUDA graphs read the new copy, not the old addresses (torch records them anew), the rollout decodes
    what the first decoded, and the log says the copy moved."""
    import logging

    from conftest import dense_copies_made

    from trainer.model.decode import Generator, Sampling
    from trainer.model.shared_base import build_shared_model, stage_specs

    model = build_shared_model(tiny_args(), stage_specs("sft", {}), vocab_size=VOCAB, device=cuda()).eval()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0)).to(cuda())
    sampling = Sampling(max_new_tokens=6, min_new_tokens=6, temperature=0)
    generator = Generator(model, "compiled", "dequantized")
    made = dense_copies_made(monkeypatch)  # holds every copy: the next is made elsewhere
    with torch.autocast("cuda", dtype=torch.bfloat16):
        first = generator.sample(ids, torch.ones_like(ids), sampling, 2, 0)
        with torch.no_grad():
            for copy in made:  # the old copies' memory no longer holds the weights
                copy.weight.fill_(float("nan"))
        with caplog.at_level(logging.INFO, logger="trainer.model.decode"):
            moved = generator.sample(ids, torch.ones_like(ids), sampling, 2, 0)
    made.clear()
    assert "the dense copies lie where no earlier decode found them (placing 2)" in caplog.text
    assert torch.equal(moved.tokens, first.tokens)
    torch.testing.assert_close(moved.logprobs, first.logprobs, rtol=0, atol=1e-5)
