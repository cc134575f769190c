"""The analytic estimator: its resident figures match the recorder's tensor walk, its formulas match
hand-computed Llama-2-7B numbers, and its CLI runs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from foundation.cli import UsageError
from foundation.settings import ModelArguments
from profiling import activations as A, components as C, predict
from profiling.advice import plan_to_fit, suggest
from profiling.predict import EstimateArguments, estimate, forward_spec, resolve_shape
from profiling.recorder import MemoryRecorder
from profiling.shapes import base_bytes, load_shape, lora_tensor_sizes
from trainer.model.shared_base import build_shared_model, stage_specs

ROOT = Path(__file__).resolve().parent.parent
COMPARED = (C.BASE_WEIGHTS, C.BASE_QUANT_CONSTANTS, C.BASE_OTHER, C.GRADIENTS, C.OPTIMIZER_STATES)


def recorded_and_estimated(model_name, quantization, stage, optimizer, lora_r, vocab=None):
    """One training step under the recorder, and the estimate of the same configuration."""
    import bitsandbytes as bnb

    args = ModelArguments(model_name_or_path=model_name, quantization=quantization, gradient_checkpointing=False,
                          lora_r=lora_r, lora_alpha=2 * lora_r)
    import tempfile

    from conftest import saved_head

    # Built the way the stages build it (trainer.model.shared_base.stage_specs); frozen heads from files.
    with tempfile.TemporaryDirectory() as heads:
        specs = stage_specs(stage, {})
        for spec in specs:
            if spec.head and not spec.trainable:
                spec.head_from = saved_head(Path(heads) / spec.name, load_shape(model_name, vocab).hidden_size)
        model = build_shared_model(args, specs, vocab_size=vocab)
    params = model.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-3) if optimizer == "adamw_torch" else bnb.optim.AdamW8bit(params, lr=1e-3)
    recorder = MemoryRecorder(stage, model=model, optimizer=opt)
    with recorder.phase("optimizer_step"):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    measured = recorder.records[(stage, "optimizer_step")].components
    est_args = EstimateArguments(model_name_or_path=model_name, stage=stage, quantization=quantization, dtype="float32",
                                 lora_r=lora_r, optimizer=optimizer, device="cpu", vocab_size=vocab)
    phases = estimate(resolve_shape(est_args), est_args)["phases"]
    predicted = next(p for p in phases if p["phase"] == "optimizer_step")["components"]
    return model, measured, predicted, est_args


def assert_exact(measured, predicted):
    """Resident components are closed forms of what the trainer allocates: equal to the byte."""
    parts = [c for c in measured if c in COMPARED or c.startswith((C.ADAPTER_PREFIX, C.HEAD_PREFIX))]
    assert set(parts) >= {C.BASE_WEIGHTS, C.BASE_OTHER, C.GRADIENTS, C.OPTIMIZER_STATES}
    for component in parts:
        assert predicted[component] == measured[component], component


@pytest.mark.parametrize("quantization, optimizer, lora_r", [
    ("none", "adamw_torch", 4),
    ("nf4", "adamw_8bit", 64),  # r=64: some LoRA tensors reach bitsandbytes' 4096-element 8-bit threshold
])
def test_estimator_matches_recorder_on_tiny_llama_ppo(quantization, optimizer, lora_r):
    _, measured, predicted, _ = recorded_and_estimated("tiny-llama", quantization, "ppo", optimizer, lora_r, vocab=512)
    assert {c for c in measured if c.startswith(C.ADAPTER_PREFIX)} == {
        C.adapter(n) for n in ("policy", "reference", "value", "reward")}
    assert_exact(measured, predicted)


@pytest.mark.slow
def test_estimator_matches_recorder_on_smollm2_fp32_reward_stage():
    _, measured, predicted, _ = recorded_and_estimated("smollm2-135m", "none", "reward", "adamw_torch", 16)
    assert measured[C.head("reward")] == (576 + 1) * 4
    assert_exact(measured, predicted)


@pytest.mark.slow
def test_estimator_matches_recorder_on_smollm2_nf4_dpo_stage():
    # torch AdamW here: bitsandbytes' 8-bit step is slow on CPU, and its byte formula is pinned on
    # tiny-llama and by hand in test_profiling_tensors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, measured, predicted, _ = recorded_and_estimated("smollm2-135m", "nf4", "dpo", "adamw_torch", 16)
    assert measured[C.BASE_QUANT_CONSTANTS] > 0
    assert {c for c in measured if c.startswith(C.ADAPTER_PREFIX)} == {C.adapter("policy"), C.adapter("reference")}
    assert_exact(measured, predicted)


# ---------------------------------------------------------------- Llama-2-7B, by hand


@pytest.fixture(scope="module")
def llama7b():
    return load_shape("llama-2-7b")


def test_llama2_7b_nf4_base_and_constants_by_hand(llama7b):
    parts = base_bytes(llama7b, "nf4", 2)
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert linear == 6_476_005_376
    assert parts[C.BASE_WEIGHTS] == linear // 2
    # per layer: attention n = 4096^2 -> 262,144 absmax bytes + 1,024 nested fp32 (4,096 B) + 1,092;
    # MLP n = 4096 x 11008 -> 704,512 + 2,752 nested fp32 (11,008 B) + 1,092
    per_layer = 4 * (262_144 + 4_096 + 1_092) + 3 * (704_512 + 11_008 + 1_092)
    assert parts[C.BASE_QUANT_CONSTANTS] == 32 * per_layer == 103_013_248
    assert parts[C.BASE_OTHER] == (2 * 32000 * 4096 + 65 * 4096) * 2 + 2 * 64 * 4


def test_llama2_7b_lora_and_kv_cache_by_hand(llama7b):
    per_layer = 16 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert sum(lora_tensor_sizes(llama7b, 16, "all-linear")) == 32 * per_layer == 39_976_960
    assert sum(lora_tensor_sizes(llama7b, 8, "q_proj,v_proj")) == 32 * 8 * 2 * 8192
    spec = A.ForwardSpec()
    assert A.kv_cache(llama7b, spec, batch=16, context=384) == 2 * 32 * 32 * 128 * 384 * 16 * 2 == 3 * 2**30


def test_checkpointing_cuts_llama2_7b_training_activations(llama7b):
    on, off = A.ForwardSpec(checkpointing=True), A.ForwardSpec(checkpointing=False)
    tokens = 4 * 512
    with_ckpt = sum(A.training_parts(llama7b, on, tokens, 512)[:2])  # kept + one layer's: the peak
    without = sum(A.training_parts(llama7b, off, tokens, 512)[:2])
    assert without > 10 * with_ckpt
    # checkpointing keeps each layer's bf16 input: at least 32 x 4096 x 2 bytes per token
    assert with_ckpt > tokens * 32 * 4096 * 2


def test_attention_auto_is_priced_as_the_model_loads_it_eager_where_its_class_has_no_sdpa():
    """A Gemma2 runs eager attention under auto (transformers gives its class no sdpa): the estimate prices the
    scores every layer holds, as an explicit eager does; a Llama under auto is priced as sdpa."""
    from profiling.shapes import ModelShape

    def peak(model_type: str, attention: str) -> int:
        shape = replace(load_shape("llama-2-7b"), model_type=model_type)
        args = EstimateArguments(model_name_or_path="llama-2-7b", stage="sft", micro_batch_size=2, max_length=1024,
                                 quantization="none", dtype="bfloat16", device="cpu", attn_implementation=attention)
        return estimate(shape, args)["peak_bytes"]

    config = dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=100)
    assert ModelShape.from_config("tiny-gemma2", config).model_type == "gemma2"  # read from its config.json
    assert peak("gemma2", "auto") == peak("gemma2", "eager") == peak("llama", "eager") > peak("llama", "auto")
    assert peak("llama", "auto") == peak("llama", "sdpa")


def test_over_budget_estimate_suggests_changes_and_a_plan_that_fits(llama7b):
    args = EstimateArguments(model_name_or_path="llama-2-7b", stage="sft", micro_batch_size=16, max_length=2048,
                             gradient_checkpointing=False, optimizer="adamw_torch")
    est = estimate(llama7b, args)
    assert not est["fits"]
    rows = suggest(llama7b, args, est)
    assert rows[0]["change"].startswith("micro_batch_size 16 -> 8")
    assert any(r["change"] == "gradient checkpointing on" for r in rows)
    assert all(r["peak_bytes"] < est["peak_bytes"] for r in rows)
    plan = plan_to_fit(llama7b, args)
    assert plan and plan[0] == "gradient checkpointing on"
    fitted = replace(args, gradient_checkpointing=True,
                     micro_batch_size=16 // 2 ** sum(step.startswith("micro_batch_size") for step in plan))
    assert estimate(llama7b, fitted)["fits"]


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_an_online_rl_run_over_budget_is_told_its_rollout_changes_with_min_new_tokens_kept_valid(llama7b, stage):
    """PPO and GRPO alike are offered fewer rows per rollout pass and shorter responses; halving max_new_tokens
    below min_new_tokens (a fixed-length recipe) lowers min_new_tokens with it, not a settings error."""
    from profiling.advice import advice_lines

    args = EstimateArguments(model_name_or_path="llama-2-7b", stage=stage, memory_budget_gib=8, max_new_tokens=128,
                             min_new_tokens=128, rollout_micro_batch_size=16)
    est = estimate(llama7b, args)
    assert not est["fits"]
    lines, rows = advice_lines(llama7b, args, est)
    changes = [row["change"] for row in rows]
    assert "max_new_tokens 128 -> 64, min_new_tokens 128 -> 64" in changes
    assert any(change.startswith("rollout_micro_batch_size 16 -> 8") for change in changes)
    assert not any(change.startswith("max_length") for change in changes)
    assert lines[0].startswith("over budget by")


def test_shape_from_a_config_folder_and_from_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}))
    shape = resolve_shape(EstimateArguments(model_name_or_path=str(tmp_path)))
    assert (shape.head_dim, shape.num_kv_heads, shape.tie_word_embeddings) == (32, 2, True)
    flags = resolve_shape(EstimateArguments(hidden_size=128, intermediate_size=344, num_layers=3, num_heads=4,
                                            num_kv_heads=2, vocab_size=1000, tie_word_embeddings=True))
    assert flags.total_params() == shape.total_params()


def test_estimate_cli_for_llama2_7b_ppo_prints_a_total_and_writes_reports(tmp_path):
    """The 7B recipe as it is (its model a hub id), offline with an empty Hugging Face cache: sized by the preset of
    the same shape, said in one line."""
    out = tmp_path / "est.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub-cache")}
    done = subprocess.run([sys.executable, "-m", "profiling.estimate", "--config", "trainer/configs/llama2_7b/ppo.yaml",
                           "--json", str(out), "--out-dir", str(tmp_path / "report")],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines() == [
        "model 'meta-llama/Llama-2-7b-hf': config.json not in the local Hugging Face cache and the hub is offline "
        "(HF_HUB_OFFLINE); sizing it as the 'llama-2-7b' preset, which has its shape"]
    assert "meta-llama/Llama-2-7b-hf (6.74B parameters), stage ppo" in done.stdout
    assert "| **total** |" in done.stdout and "peak:" in done.stdout and "fits" in done.stdout
    data = json.loads(out.read_text())
    assert [p["phase"] for p in data["phases"]] == ["generate", "score", "update", "optimizer_step"]
    assert data["fits"] and data["peak_bytes"] == max(p["total"] for p in data["phases"])
    assert (tmp_path / "report" / "estimate.md").is_file() and (tmp_path / "report" / "estimate.png").is_file()


def test_the_seed_comparison_sets_seed_000_s_ranges_beside_the_estimate():
    from benchmarks.seed import main

    rows = {r["component"]: r for r in main(["--model", "llama-2-7b", "--stage", "ppo"])}
    assert set(rows) == {"base", "lora", "optimizer", "activations", "kv_cache", "total"}
    assert (rows["optimizer"]["seed_low"], rows["optimizer"]["seed_high"]) == (8.0, 10.0)
    assert rows["optimizer"]["ours_bytes"] < 2 * 2**30  # LoRA-only optimizer states, not full fine-tuning
    assert rows["total"]["ours_bytes"] <= 24 * 2**30


def test_ppo_s_routed_passes_hold_every_adapter_s_rows_at_once():
    """The scoring pass stacks the reference, value and reward rows (the policy's log-probs were read while
    sampling); the update stacks policy and value rows; sampling keeps one step's logits."""
    shape = load_shape("llama-2-7b")
    args = EstimateArguments(stage="ppo").resolved()
    data = {p["phase"]: p for p in estimate(shape, args)["phases"]}
    phases = {name: p["components"] for name, p in data.items()}
    peaks = {name: p["term_peaks"] for name, p in data.items()}
    assert list(phases) == ["generate", "score", "update", "optimizer_step"]
    spec = predict.forward_spec(args, 2)
    rows, context, mb = args.rollout_micro_batch_size, args.max_prompt_length + args.max_new_tokens, args.micro_batch_size
    act, logits = C.ACTIVATIONS, C.LOGITS
    # every scoring adapter's rows in one pass, sharing one copy of the dequantized weight
    dequantized = A.dequantized_weight_bytes(shape, spec)
    one_pass = A.nograd_activations(shape, spec, rows * context, context)
    assert phases["score"][act] - dequantized == 3 * (one_pass - dequantized)
    assert phases["score"][act] == A.nograd_activations(shape, spec, 3 * rows * context, context)
    # the reference's response log-probs alone, one chunk of the head at a time: the value and reward heads give none
    # (after the layers: the phase peaks in the layers, where no logits are alive)
    assert peaks["score"][logits] == A.head_logprobs_nograd(shape, spec, rows * args.max_new_tokens)
    assert phases["score"][logits] == 0
    # the update's policy and value rows as one batch of two trainable adapters; the LM head's backward runs
    # beside the kept layer inputs alone, a layer's backward after it
    kept, layer, _ = A.training_parts(shape, spec, 2 * mb * context, context, adapters=2)
    head = A.head_logprobs_training(shape, spec, mb * args.max_new_tokens)
    assert layer > head and phases["update"][act] == kept + layer and phases["update"][logits] == 0
    assert peaks["update"][logits] == head
    # sampling keeps one step's logits (bf16, rows x 32000) and the pick's four fp32 buffers of their size
    # (measured: tests/test_decode.py)
    assert peaks["generate"][logits] == rows * 32000 * (2 + 4 * 4)


@pytest.mark.parametrize("stage", ["reward", "dpo"])
def test_one_row_pairs_add_their_mask_and_eager_attention_s_longer_rows(stage):
    shape = load_shape("llama-2-7b")  # micro-batch 4 pairs, max_length 512, bf16, checkpointing: the defaults

    def phases(share, attention):
        args = EstimateArguments(stage=stage, share_pair_prompts=share, attn_implementation=attention)
        return {p["phase"]: p["components"][C.ACTIVATIONS] for p in estimate(shape, args)["phases"]
                if p["phase"] in ("forward_backward", "reference")}

    mask = 4 * 1024 * 1024 * (1 + 2)  # (4, 1, 1024, 1024) bool, and its bf16 additive copy
    one, two = phases(True, "sdpa"), phases(False, "sdpa")
    assert set(one) == ({"forward_backward", "reference"} if stage == "dpo" else {"forward_backward"})
    assert all(one[p] - two[p] == mask for p in one)  # the same tokens; SDPA keeps no T x T probabilities
    assert phases(True, "flash_attention_2") == phases(False, "flash_attention_2")  # falls back to two rows
    # eager: each token's probabilities span a row twice as long (one layer of them recomputed under checkpointing)
    eager_one, eager_two = phases(True, "eager"), phases(False, "eager")
    tokens = 2 * 4 * 512
    assert eager_one["forward_backward"] - eager_two["forward_backward"] == mask + tokens * 6 * shape.num_heads * 512


# ---------------------------------------------------------------- runs without a reference or a reward model

LLAMA7B_ADAPTER = 4 * 39_976_960  # one fp32 LoRA r=16 on all linears (test_llama2_7b_lora_and_kv_cache_by_hand)
LLAMA7B_HEAD = 4 * (4096 + 1)  # a scalar head: Linear(4096, 1), fp32


def _by_phase(args):
    return {p["phase"]: p for p in estimate(load_shape("llama-2-7b"), args)["phases"]}


def _held(components, prefix):
    return {c for c in components if c.startswith(prefix)}


def test_grpo_with_beta_0_and_reward_functions_holds_the_policy_adapter_alone():
    full = _by_phase(EstimateArguments(stage="grpo"))
    lean = _by_phase(EstimateArguments(stage="grpo", beta=0, reward_model=False))
    assert list(lean) == list(full) == ["generate", "score", "update", "optimizer_step"]
    for phase in lean.values():
        assert _held(phase["components"], C.ADAPTER_PREFIX) == {C.adapter("policy")}
        assert not _held(phase["components"], C.HEAD_PREFIX)
    assert _held(full["update"]["components"], C.ADAPTER_PREFIX) == {
        C.adapter(n) for n in ("policy", "reference", "reward")}
    # the same transient tensors; the reference adapter and the reward adapter with its head are gone
    for name in ("generate", "update", "optimizer_step"):
        assert full[name]["peak_allocated"] - lean[name]["peak_allocated"] == 2 * LLAMA7B_ADAPTER + LLAMA7B_HEAD
    # sampled log-probs, no reference, scripted scores: the score phase runs no pass
    assert lean["score"]["components"][C.ACTIVATIONS] == lean["score"]["components"][C.LOGITS] == 0
    assert full["score"]["term_peaks"][C.LOGITS] > 0
    # either one alone leaves the other adapter in
    assert _held(_by_phase(EstimateArguments(stage="grpo", beta=0))["update"]["components"], C.ADAPTER_PREFIX) == {
        C.adapter("policy"), C.adapter("reward")}
    assert _held(_by_phase(EstimateArguments(stage="grpo", reward_model=False))["update"]["components"],
                 C.ADAPTER_PREFIX) == {C.adapter("policy"), C.adapter("reference")}


def test_ppo_scored_by_reward_functions_keeps_policy_reference_and_value():
    full = _by_phase(EstimateArguments(stage="ppo"))
    lean = _by_phase(EstimateArguments(stage="ppo", reward_model=False, beta=0))  # beta is GRPO's: PPO keeps reference
    for phase in lean.values():
        assert _held(phase["components"], C.ADAPTER_PREFIX) == {C.adapter(n) for n in ("policy", "reference", "value")}
        assert _held(phase["components"], C.HEAD_PREFIX) == {C.head("value")}
    for name in ("generate", "update", "optimizer_step"):
        assert full[name]["peak_allocated"] - lean[name]["peak_allocated"] == LLAMA7B_ADAPTER + LLAMA7B_HEAD
    # the routed scoring pass: reference and value rows, no reward rows (3 groups -> 2), one dequantized weight
    spec = predict.forward_spec(EstimateArguments().resolved(), 2)
    dequantized = A.dequantized_weight_bytes(load_shape("llama-2-7b"), spec)
    act = [p["score"]["components"][C.ACTIVATIONS] - dequantized for p in (full, lean)]
    assert 2 * act[0] == 3 * act[1]


def test_of_run_reads_beta_and_the_scorer_off_a_run_s_settings():
    from types import SimpleNamespace

    from foundation.settings import GRPOArguments, PPOArguments

    model = ModelArguments(model_name_or_path="llama-2-7b")
    grpo = GRPOArguments(beta=0.0, scripted_reward="length:50")
    saved = SimpleNamespace(**json.loads(json.dumps(vars(grpo))))  # a config.json section, as vs_estimate reads it
    for stage_args in (grpo, saved):
        args = EstimateArguments.of_run(model, stage_args, stage="grpo")
        assert (args.beta, args.reward_model, predict.roles(args)) == (0.0, False, ["policy"])
    scripted = EstimateArguments.of_run(model, PPOArguments(scripted_reward="keyword:yes"), stage="ppo")
    assert (scripted.reward_model, predict.roles(scripted)) == (False, ["policy", "reference", "value"])
    # a reward adapter is loaded whenever it is named (it also starts the value adapter), beside a scripted reward too
    both = PPOArguments(reward_adapter="runs/reward/adapter", scripted_reward="keyword:yes")
    assert predict.roles(EstimateArguments.of_run(model, both, stage="ppo")) == [
        "policy", "reference", "value", "reward"]
    kept = EstimateArguments.of_run(model, GRPOArguments(reward_adapter="runs/reward/adapter"), stage="grpo")
    assert (kept.beta, predict.roles(kept)) == (0.04, ["policy", "reference", "reward"])


def test_the_estimate_command_reads_the_scorer_off_the_reward_adapter_named_as_a_run_does():
    """`python -m profiling.estimate --config grpo.yaml --reward_adapter null` estimates what that run loads: no
    reward adapter (the config's names one: it is loaded); --reward_model says so outright and wins."""
    from profiling.estimate import parse_estimate

    config = ["--config", str(ROOT / "trainer" / "configs" / "llama2_7b" / "grpo.yaml"), "--stage", "grpo"]
    assert "reward" in predict.roles(parse_estimate(config))
    assert "reward" not in predict.roles(parse_estimate([*config, "--reward_adapter", "null"]))
    assert "reward" in predict.roles(parse_estimate([*config, "--reward_adapter", "null", "--reward_model", "true"]))
    assert parse_estimate(["--stage", "ppo"]).reward_model  # nothing named: the usual PPO, a reward model


def test_a_dense_copy_of_the_4bit_weights_weighs_on_the_generate_phase_or_on_every_phase():
    """generation_weights: `dequantized` holds the copy (every linear layer in the compute dtype) through the
    generate phase only, `resident` in every phase; a base not in 4 bits, or auto, has none. With a copy the
    prompt's forward dequantizes no 4-bit weight."""
    from profiling.predict import generation_weight_bytes

    shape = load_shape("llama-2-7b")
    args = EstimateArguments(stage="grpo", rollout_batch_size=4, num_generations=4, rollout_micro_batch_size=16,
                             mixed_precision="no")  # no LoRA copies in the autocast dtype (the test below)
    copy = generation_weight_bytes(shape, 2)
    assert copy == shape.linear_params() * 2 and 12 < copy / 2**30 < 12.2
    phases = {w: {p["phase"]: p for p in estimate(shape, replace(args, generation_weights=w))["phases"]}
              for w in ("quantized", "dequantized", "resident", "auto")}
    for name, phase in phases["quantized"].items():
        grown = phases["dequantized"][name]["peak_allocated"] - phase["peak_allocated"]
        dequantized = 2 * max(a * b for _, a, b in shape.linears())  # the prefill's, when it is the phase's peak
        assert grown == (copy - dequantized if name == "generate" else 0), name
        assert phases["resident"][name]["components"][C.GENERATION_WEIGHTS] == copy
        assert phases["auto"][name] == phase
    none = estimate(shape, replace(args, quantization="none", generation_weights="resident"))
    assert all(C.GENERATION_WEIGHTS not in p["components"] for p in none["phases"])


def test_the_policy_s_lora_copy_in_the_autocast_dtype_weighs_on_every_phase_compiled_else_on_generate():
    """Under mixed precision a decode multiplies a bf16 copy of the policy's LoRA weights
    (trainer.model.decode_weights.lora_compute_copies): kept between rollouts by the compiled step, held through
    generate by the eager one; none without autocast."""
    from profiling.predict import decode_lora_bytes
    from profiling.shapes import lora_tensor_sizes

    shape = load_shape("llama-2-7b")
    args = EstimateArguments(stage="grpo", rollout_batch_size=4, num_generations=4, rollout_micro_batch_size=16,
                             generation_weights="quantized", mixed_precision="bf16")
    lora = decode_lora_bytes(shape, args)
    assert lora == 2 * sum(lora_tensor_sizes(shape, args.lora_r, args.lora_target_modules)) > 0
    for decode, held_in in (("compiled", {"generate", "score", "update", "optimizer_step"}), ("eager", {"generate"})):
        phases = estimate(shape, replace(args, decode=decode))["phases"]
        assert {p["phase"] for p in phases if p["components"].get(C.GENERATION_WEIGHTS) == lora} == held_in, decode
    none = estimate(shape, replace(args, mixed_precision="no"))["phases"]
    assert all(C.GENERATION_WEIGHTS not in p["components"] for p in none)


def test_the_compiled_decode_keeps_its_full_length_kv_cache_in_every_phase():
    """--decode compiled keeps one static KV cache per batch size between rollouts (trainer.model.decode):
    prompt + new tokens rounded up to 128 positions, in every phase; eager decoding's grows in generate only.
    auto is compiled on CUDA, eager on the CPU and with the embedding in host memory (profiling.resolve)."""
    shape = load_shape("llama-2-7b")
    args = EstimateArguments(stage="ppo", rollout_batch_size=16, rollout_micro_batch_size=16,
                             max_prompt_length=200, max_new_tokens=128)
    eager = {p["phase"]: p for p in estimate(shape, replace(args, decode="eager"))["phases"]}
    compiled = {p["phase"]: p for p in estimate(shape, replace(args, decode="compiled"))["phases"]}
    assert {p["phase"]: p for p in estimate(shape, replace(args, decode="auto"))["phases"]} == compiled
    assert estimate(shape, replace(args, offload_embeddings=True)) == estimate(
        shape, replace(args, offload_embeddings=True, decode="eager"))
    assert replace(args, device="cpu").resolved().decode == "eager"
    spec = forward_spec(args.resolved(), 2)
    kept = A.compiled_kv_cache(shape, spec, 16, 328)
    assert kept == A.kv_cache(shape, spec, 16, 384)
    for name, phase in compiled.items():
        assert phase["components"][C.KV_CACHE] == kept, name
        assert eager[name]["components"].get(C.KV_CACHE, 0) == (
            A.kv_cache(shape, spec, 16, 328) + A.kv_cache_growth(shape, spec, 16, 328) if name == "generate" else 0)


RUN_CLASSES = ("ModelArguments", "DataArguments", "TrainArguments", "RolloutArguments", "PPOArguments",
               "GRPOArguments")


def test_the_estimator_declares_none_of_the_run_s_settings_and_reads_them_all():
    """One owner per setting: EstimateArguments derives from the run's argument classes; what it declares
    itself (the stage, the device, shape overrides, assumptions) no run class declares."""
    import dataclasses

    import foundation.settings as settings
    from trainer.dpo import DPOArguments
    from trainer.reward import RewardArguments
    from trainer.sft import SFTArguments

    run = {f.name for name in RUN_CLASSES for f in dataclasses.fields(getattr(settings, name))}
    own = set(EstimateArguments.__dict__["__annotations__"])
    stage_own = {f.name for cls in (SFTArguments, RewardArguments, DPOArguments) for f in dataclasses.fields(cls)}
    assert own and not own & (run | stage_own - {"beta"}), own & run
    assert run <= {f.name for f in dataclasses.fields(EstimateArguments)}
    for name in RUN_CLASSES:  # and with the run's defaults
        for f in dataclasses.fields(getattr(settings, name)):
            assert getattr(EstimateArguments(), f.name) == getattr(getattr(settings, name)(), f.name), f.name


def test_a_renamed_run_setting_is_the_estimator_s_under_its_new_name(tmp_path):
    """Rename rollout_batch_size in the run's settings (a copy of the tree): the estimator's field is renamed
    with it, and a run's value reaches the estimate under the new name - no stale copy with its own default."""
    for package in ("foundation", "profiling"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "foundation" / "settings.py"
    text = source.read_text()
    assert text.count("    rollout_batch_size: int = field(") == 1
    source.write_text(text.replace("rollout_batch_size", "prompts_per_step"))
    probe = ("import dataclasses, types; from profiling.predict import EstimateArguments as E; "
             "names = {f.name for f in dataclasses.fields(E)}; "
             "assert 'prompts_per_step' in names and 'rollout_batch_size' not in names, names; "
             "run = types.SimpleNamespace(prompts_per_step=3); "
             "print(E.of_run(run, stage='ppo').prompts_per_step)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"


def test_the_estimator_reads_a_stage_s_config_file_and_plans_what_it_leaves_auto(capsys, tmp_path):
    """`python -m profiling.estimate --config` reads the recipe the run reads: its settings, and the plan a
    CUDA run makes of those it leaves auto (the 7B recipe's batch sizes and checkpointing)."""
    from profiling.estimate import main, parse_estimate

    argv = ["--config", "trainer/configs/llama2_7b/ppo.yaml", "--stage", "ppo", "--model_name_or_path", "llama-2-7b"]
    args = parse_estimate(argv)
    assert (args.rollout_batch_size, args.mini_batch_size, args.max_new_tokens, args.lora_dropout) == (16, 8, 128, 0.0)
    assert args.quantization == "nf4" and args.memory_budget_gib == 24
    main([*argv, "--json", str(tmp_path / "estimate.json")])
    assert json.loads((tmp_path / "estimate.json").read_text())
    out = capsys.readouterr().out
    assert "budget plan" in out and "micro_batch_size 8  (planned)" in out
    main([*argv, "--micro_batch_size", "2"])
    assert "micro_batch_size 2  (set)" in capsys.readouterr().out


def test_cards_lists_which_cards_hold_the_run_with_the_plan_each_gets_and_the_smallest(capsys):
    """`--cards`: each size as the run's memory_budget_gib, planned as a CUDA run plans it; the smallest that holds
    the run is the smallest the planner fits (PPO), and a stage the planner does not plan fits by its peak."""
    import re

    from profiling.estimate import main, parse_estimate
    from profiling.plan import PLANNABLE, planned_settings

    argv = ["--config", "trainer/configs/llama2_7b/ppo.yaml", "--stage", "ppo", "--model_name_or_path", "llama-2-7b"]
    main([*argv, "--cards", "24,6,4,12"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| ([\d.]+) \| (yes|\*\*no\*\*) \| ([\d.]+) \((\w+)\) \| (.+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["4", "6", "12", "24"]
    args = parse_estimate(argv)
    shape = resolve_shape(args)
    for gib, fits, peak, _, settings in rows:
        planned, plan = planned_settings(shape, replace(args, memory_budget_gib=float(gib)), set(PLANNABLE))
        assert (fits == "yes") == (plan is not None)
        if plan is not None:
            assert f"{plan.rollout_micro_batch_size} rows a generate/score pass, micro-batch {plan.micro_batch_size}" \
                in settings and float(peak) == pytest.approx(plan.peak_bytes / 2**30, abs=1e-3)
    smallest = min(float(r[0]) for r in rows if r[1] == "yes")
    assert rows[0][1] == "**no**" and f"smallest card that holds it: {smallest:g} GiB" in out
    main(["--model", "llama-2-7b", "--stage", "sft", "--quantization", "nf4", "--cards", "2,48"])
    out = capsys.readouterr().out
    assert "| 2 | **no** |" in out and "| 48 | yes |" in out and "the settings as given" in out
    assert "smallest card that holds it: 48 GiB" in out
    main(["--model", "llama-2-7b", "--stage", "sft", "--quantization", "none", "--cards", "1"])
    assert "none of the cards holds it (largest 1 GiB)" in capsys.readouterr().out

    with pytest.raises(UsageError, match="--cards '8,x': must be card sizes in GiB"):
        parse_estimate(["--cards", "8,x"])


def test_cards_with_out_dir_writes_the_answer_with_its_provenance(tmp_path, capsys):
    from profiling.estimate import main

    main(["--model", "llama-2-7b", "--stage", "grpo", "--scripted_reward", "chars:200", "--reward_adapter", "null",
          "--cards", "6,12", "--out_dir", str(tmp_path)])
    record = json.loads((tmp_path / "cards.json").read_text())
    assert record["command"].startswith("python -m profiling.estimate --model llama-2-7b --stage grpo")
    assert record["git_revision"] and record["device"] == "estimate" and record["stage"] == "grpo"
    assert record["setting"] == "nf4, paged_adamw_8bit, LoRA r=16, 32 rows x (256 + 32) tokens a step"  # defaults
    assert [r["card_gib"] for r in record["rows"]] == [6.0, 12.0]
    assert record["smallest_gib"] == next(r["card_gib"] for r in record["rows"] if r["fits"])
    assert all(r["plan"] is None or r["plan"]["rollout_micro_batch_size"] >= 1 for r in record["rows"])
    text = (tmp_path / "cards.md").read_text()
    assert text.startswith("# Which cards hold it: llama-2-7b grpo (an estimate)")
    assert f"smallest card that holds it: {record['smallest_gib']:g} GiB" in text


class FakeNvml:
    """pynvml's calls cuda_context_bytes makes, with this process holding `used` bytes by NVML's count."""

    class NVMLError(Exception):
        pass

    def __init__(self, pid: int, used):
        self.pid, self.used = pid, used

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from types import SimpleNamespace

        return [SimpleNamespace(pid=self.pid + 1, usedGpuMemory=10 * 2**30),
                SimpleNamespace(pid=self.pid, usedGpuMemory=self.used)]


def test_the_cuda_context_is_nvml_s_figure_for_this_process_less_the_allocator_s(monkeypatch):
    from profiling import device as D

    monkeypatch.setattr(D, "cuda_unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2**30)
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(os.getpid(), 3 * 2**30 + 2**29))
    assert D.cuda_context_bytes(cuda) == (2**30 + 2**30 + 2**29, None)  # 3.5 GiB used, 1 GiB the allocator's
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(os.getpid() + 7, 3 * 2**30))  # a container's other pid
    measured, why = D.cuda_context_bytes(cuda)
    assert measured is None and "process ids" in why
    monkeypatch.undo()
    measured, why = D.cuda_context_bytes(torch.device("cpu"))
    assert measured is None and "not CUDA" in why


def test_a_cuda_run_s_budget_check_estimates_with_the_context_it_measured(monkeypatch):
    from types import SimpleNamespace

    import trainer.engine.budget as budget
    from foundation.settings import DataArguments, ModelArguments, PPOArguments, TrainArguments

    monkeypatch.setattr(budget, "warm_up", lambda device: None)
    monkeypatch.setattr(budget, "cuda_context_bytes", lambda device: (int(1.4 * 2**30), None))
    budget.cuda_context_gib.cache_clear()
    from foundation.run_plan import RunPlan
    from trainer.engine.launch import Launch

    settings = (ModelArguments(), DataArguments(), TrainArguments(), PPOArguments())
    plan, cuda = RunPlan.of(settings[0], settings[2], settings[3]), torch.device("cuda", 0)
    args = budget.estimate_arguments("ppo", plan, settings, cuda, Launch())
    assert args.cuda_context_gib == pytest.approx(1.4)
    monkeypatch.setattr(budget, "cuda_context_bytes", lambda device: (None, "no NVML here"))
    budget.cuda_context_gib.cache_clear()
    args = budget.estimate_arguments("ppo", plan, settings, cuda, Launch())
    assert args.cuda_context_gib == EstimateArguments().cuda_context_gib  # the assumption, said in the log
    budget.cuda_context_gib.cache_clear()


def test_the_estimate_s_cuda_context_adds_the_kernels_cuda_loads_after_the_start():
    """A run measures its CUDA context at the start; the kernels CUDA loads as the run first calls them come
    on top, in every phase (assumed), and nothing of either on the CPU."""
    from profiling.estimate import parse_estimate

    args = parse_estimate(["--model", "tiny-llama", "--stage", "sft", "--device", "cuda", "--cuda_context_gib", "0.66",
                           "--cuda_kernels_gib", "0.9"])
    est = estimate(resolve_shape(args), args)
    assert {p["components"][C.CUDA_CONTEXT] for p in est["phases"]} == {int(0.66 * C.GIB + 0.9 * C.GIB)}
    assert EstimateArguments().cuda_kernels_gib == 0.9
    args = parse_estimate(["--model", "tiny-llama", "--stage", "sft", "--device", "cpu"])
    assert {p["components"][C.CUDA_CONTEXT] for p in estimate(resolve_shape(args), args)["phases"]} == {0}


def test_a_simulated_card_leaves_the_cuda_context_and_later_kernels_outside_the_allocator(monkeypatch, caplog):
    """--simulate_gpu_gib G: the allocator gets G less the context measured at start and the kernels assumed
    to load later, so that the device memory the run holds (NVML) stays within G; a card too small for even
    that is refused in one line, and a CPU run ignores the cap."""
    import trainer.engine.budget as budget
    from trainer.engine.setup import simulate_gpu_memory

    fractions = []
    monkeypatch.setattr(budget, "warm_up", lambda device: None)
    monkeypatch.setattr(budget, "cuda_context_bytes", lambda device: (int(0.66 * 2**30), None))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index: fractions.append((f, index)))
    budget.cuda_context_gib.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        with caplog.at_level(logging.INFO, logger="trainer.engine.setup"):
            simulate_gpu_memory(12, cuda)
        assert fractions == [(pytest.approx((12 - 0.66 - 0.9) / 80), 0)]
        assert "the allocator gets 10.44 GiB" in caplog.text and "0.66 GiB measured at start" in caplog.text
        assert budget.context_at_start(cuda) == int(0.66 * 2**30)
        with pytest.raises(UsageError, match=r"--simulate_gpu_gib 1.5: CUDA alone holds 1.56 GiB outside the allocator \(the CUDA context"):
            simulate_gpu_memory(1.5, cuda)
        monkeypatch.setattr(budget, "cuda_context_bytes", lambda device: (None, "no NVML here"))
        budget.cuda_context_gib.cache_clear()
        simulate_gpu_memory(8, cuda)  # nothing measured: the estimator's assumption at start
        assert fractions[-1] == (pytest.approx((8 - EstimateArguments().cuda_context_gib - 0.9) / 80), 0)
        assert budget.context_at_start(cuda) is None
        simulate_gpu_memory(8, torch.device("cpu"))
        assert len(fractions) == 2 and budget.context_at_start(torch.device("cpu")) is None
    finally:
        budget.cuda_context_gib.cache_clear()


def test_every_phase_holds_the_peak_phase_s_device_memory():
    """The caching allocator keeps the largest phase's blocks reserved through the next step (a recorded run
    shows one reserved figure in every phase): each phase's `device_total` is the peak phase's total, while
    its `total` stays what the phase itself needs (what the planner fits)."""
    shape = load_shape("qwen2.5-7b")
    args = EstimateArguments(model_name_or_path="qwen2.5-7b", stage="grpo", beta=0.0, reward_model=False,
                             rollout_batch_size=1, num_generations=8, max_new_tokens=256, max_prompt_length=256,
                             micro_batch_size=8, rollout_micro_batch_size=8, generation_weights="dequantized")
    est = estimate(shape, args)
    assert {p["device_total"] for p in est["phases"]} == {est["peak_bytes"]}
    assert len({p["total"] for p in est["phases"]}) == len(est["phases"])
    assert next(p for p in est["phases"] if p["phase"] == est["peak_phase"])["total"] == est["peak_bytes"]


@pytest.mark.parametrize("decode, weights", [("compiled", "dequantized"), ("eager", "resident")])
def test_a_dense_copy_holds_the_policy_s_lora_a_and_adds_to_the_lora_copies_decoding_holds(decode, weights):
    """Under mixed precision a dense copy has rows for the policy's LoRA-A
    (trainer.model.decode_weights.DequantizedLinear) and a decode copies lora_B alone; in generate the copy adds
    to those copies, whichever phase holds which (the compiled step keeps its copies in every phase, a resident
    copy is in every phase)."""
    from profiling.predict import decode_lora_bytes, generation_weight_bytes
    from profiling.shapes import lora_tensor_sizes

    shape = load_shape("llama-2-7b")
    args = EstimateArguments(stage="grpo", rollout_batch_size=4, num_generations=4, rollout_micro_batch_size=16,
                             generation_weights=weights, decode=decode, mixed_precision="bf16")
    sizes = lora_tensor_sizes(shape, args.lora_r, args.lora_target_modules)
    copy, lora = generation_weight_bytes(shape, 2, args), decode_lora_bytes(shape, args)
    assert copy == 2 * (shape.linear_params() + sum(sizes[::2])) and lora == 2 * sum(sizes[1::2]) > 0
    held = {p["phase"]: p["components"].get(C.GENERATION_WEIGHTS, 0) for p in estimate(shape, args)["phases"]}
    assert held["generate"] == copy + lora
    assert held["score"] == (lora if decode == "compiled" else copy)


@pytest.mark.parametrize("config, says", [
    ({"model_type": "llama", "num_hidden_layers": 2}, "no 'hidden_size' in it (a Llama-architecture decoder is sized "
     "from hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size): add it, or give the "
     "whole shape with --hidden_size, --intermediate_size, --num_layers, --num_heads and --vocab_size"),
    ({"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 0,
      "vocab_size": 100}, "'num_attention_heads' is 0, not a positive integer"),
    ({"hidden_size": "64", "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 100}, "'hidden_size' is \"64\", not a positive integer"),
    ([1, 2], "expected a JSON object of model settings, found a list"),
], ids=["no-hidden-size", "zero-heads", "text-width", "a-list"])
def test_an_odd_model_config_is_one_line_naming_the_file_and_the_key(tmp_path, config, says, capsys):
    from foundation.cli import run
    from profiling.estimate import main

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        run(main, ["--model_name_or_path", str(tmp_path)])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {tmp_path / 'config.json'}: {says}"]


# ---- hub ids --------------------------------------------------------------------------------

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hugging Face cache; the hub lookups of earlier tests forgotten."""
    from huggingface_hub import constants

    from profiling import shapes

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    shapes.hub_config.cache_clear()
    yield tmp_path / "hub"
    shapes.hub_config.cache_clear()


def cache_config(cache: Path, repo_id: str, config: dict) -> None:
    """`repo_id`'s config.json laid out in `cache` as huggingface_hub stores a download."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))


def test_a_hub_id_reads_its_config_from_the_local_cache(hub_cache, caplog):
    cache_config(hub_cache, "someone/my-model", {"model_type": "qwen2", "hidden_size": 96, "intermediate_size": 200,
                                                 "num_hidden_layers": 3, "num_attention_heads": 6,
                                                 "num_key_value_heads": 2, "vocab_size": 1000})
    with caplog.at_level(logging.WARNING):
        shape = load_shape("someone/my-model")
    assert (shape.name, shape.hidden_size, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.qkv_bias) == \
        ("someone/my-model", 96, 3, 2, 16, True)
    assert caplog.records == []  # nothing to say: the model's own config.json


def test_a_cached_config_wins_over_the_preset_of_a_well_known_id(hub_cache):
    cache_config(hub_cache, "meta-llama/Llama-2-7b-hf", {"hidden_size": 64, "intermediate_size": 172,
                                                         "num_hidden_layers": 2, "num_attention_heads": 4,
                                                         "vocab_size": 100})
    assert load_shape("meta-llama/Llama-2-7b-hf").hidden_size == 64


@pytest.mark.parametrize("repo_id, preset", [("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
                                             ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
                                             ("qwen/qwen2.5-7b-instruct", "qwen2.5-7b"),
                                             ("mistralai/Mistral-7B-v0.3", "mistral-7b"),
                                             ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m")])
def test_offline_and_uncached_a_well_known_id_is_sized_by_its_preset_said_once(hub_cache, repo_id, preset, caplog):
    from profiling import shapes

    shapes.said_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="profiling.shapes"):
        shape, again = load_shape(repo_id), load_shape(repo_id)
    assert shape == again and shape.name == repo_id
    assert shape.total_params() == load_shape(preset).total_params()
    assert [r.getMessage() for r in caplog.records] == [
        f"model '{repo_id}': config.json not in the local Hugging Face cache and the hub is offline (HF_HUB_OFFLINE); "
        f"sizing it as the '{preset}' preset, which has its shape"]


def test_offline_and_uncached_any_other_id_is_one_line_saying_how_to_give_a_folder(hub_cache, capsys):
    from foundation.cli import run
    from profiling.estimate import main

    with pytest.raises(SystemExit) as stop:
        run(main, ["--model_name_or_path", "someone/unknown-7b"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model 'someone/unknown-7b': its config.json is not in the local Hugging Face cache and the hub is "
        "offline (HF_HUB_OFFLINE). Give a folder holding it (huggingface-cli download someone/unknown-7b config.json "
        "--local-dir DIR, then --model_name_or_path DIR), or a preset (tiny-llama, llama-2-7b, llama-2-13b, "
        "llama-3.1-8b, qwen2.5-7b, mistral-7b)"]


def test_online_a_hub_id_downloads_its_config_and_a_failed_download_is_said(hub_cache, tmp_path, monkeypatch):
    import huggingface_hub

    from profiling import shapes

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "intermediate_size": 64,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                                      "vocab_size": 50}))
    asked = []
    monkeypatch.setattr(shapes, "hub_offline", lambda: False)
    monkeypatch.setattr(shapes, "hub_unreachable", lambda: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo_id, filename, **kw: asked.append((repo_id, filename)) or str(tmp_path / filename))
    assert load_shape("someone/online-model").hidden_size == 32 and asked == [("someone/online-model", "config.json")]

    def gated(repo_id, filename, **kw):
        raise OSError(f"401: {repo_id} is gated, log in")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    with pytest.raises(UsageError, match=r"the hub did not give it \(401: someone/gated is gated, log in\)"):
        load_shape("someone/gated")


def test_the_hub_s_host_refusing_a_connection_counts_as_unreachable(monkeypatch):
    from huggingface_hub import constants

    from profiling.shapes import hub_unreachable

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert hub_unreachable(timeout_s=2).startswith("127.0.0.1: ")


# ---- where the estimate is written -----------------------------------------------------------

def estimate_exit(capsys, *argv: str) -> tuple[int, list[str]]:
    from foundation.cli import run
    from profiling.estimate import main

    with pytest.raises(SystemExit) as stop:
        run(main, ["--model", "llama-2-7b", "--stage", "sft", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    return stop.value.code, err.strip().splitlines()


@pytest.fixture
def read_only_folder(tmp_path):
    """An empty folder on a real read-only filesystem (a tmpfs mounted ro); skipped where mount is not allowed."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield folder
    subprocess.run(["umount", str(folder)], capture_output=True)


def test_an_out_dir_that_is_a_file_or_a_json_that_is_a_folder_is_one_line_before_the_estimate(tmp_path, capsys):
    afile, afolder = tmp_path / "a-file", tmp_path / "a-folder"
    afile.write_text("mine")
    afolder.mkdir()
    assert estimate_exit(capsys, "--out_dir", str(afile)) == (
        2, [f"error: --out_dir {afile}: it is a file, not a folder; pick another place"])
    assert estimate_exit(capsys, "--json", str(afolder)) == (
        2, [f"error: --json {afolder}: it is a folder; pick another place"])
    assert estimate_exit(capsys, "--json", str(afile / "estimate.json")) == (
        2, [f"error: --json {afile / 'estimate.json'}: it is not usable (Not a directory); pick another place"])
    assert afile.read_text() == "mine" and list(afolder.iterdir()) == []


@pytest.mark.parametrize("flag, name", [("--out_dir", "reports"), ("--json", "estimate.json")])
def test_an_estimate_written_to_a_read_only_filesystem_is_one_line(flag, name, read_only_folder, capsys):
    target = read_only_folder / name
    code, err = estimate_exit(capsys, flag, str(target))
    assert code == 2 and err == [f"error: {flag} {target}: cannot write in {read_only_folder} (Read-only file "
                                 "system); free space or pick another place"]


def test_reports_that_do_not_all_fit_under_a_file_size_limit_leave_none_of_them(tmp_path, forks):
    """estimate.json and .md fit 30 KB, the chart does not: one line, and none of the three is left."""
    from conftest import limited_run

    out = tmp_path / "reports"
    done = limited_run(forks, "profiling.estimate", ["--model", "llama-2-7b", "--stage", "sft", "--out_dir", str(out)],
                       file_size=30_000)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out_dir {out}: could not be written (File too large; ")
    assert lines[0].endswith(" GiB free there); raise the file size limit (ulimit -f) and rerun")
    assert list(out.iterdir()) == []
