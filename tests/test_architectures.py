"""Every common decoder architecture, as a tiny random model saved from `AutoConfig.for_model` and passed as a
folder (`--model_name_or_path DIR`), as a user passes their own: one step of each stage, greedy decoding equal
to transformers' `generate`, sampled log-probs equal to a scoring pass, routed passes and one-row preference pairs
equal to separate ones, the decode's joined sibling matrices, the merged export; and the attention
implementation `auto` picks from what each architecture supports.

Each model keeps what sets its family apart, made to matter at this size: weights drawn wide enough that
logits differ by whole units, sliding windows (Mistral, Gemma 2 and 3) shorter than a rollout, Gemma 2's soft-caps
where they bend its logits, tied embeddings (Gemma), biases on q/k/v (Qwen2), q/k norms (Qwen3), fused qkv and
gate/up matrices (Phi-3), no grouped-query attention and a partial rotary (GPT-NeoX).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import base_only

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "tests" / "configs" / "tiny_recipe"
CPU = torch.device("cpu")

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=512, initializer_range=0.2)
GQA = dict(num_key_value_heads=2)
# Gemma scales its input embedding by sqrt(hidden) and ties it to the head: drawn at 0.2, every position would
# predict its own token again; narrower, the context moves the choice
GEMMA = dict(GQA, head_dim=16, sliding_window=8, initializer_range=0.05)
ARCHITECTURES = {
    "llama": GQA,
    "mistral": dict(GQA, sliding_window=8),
    "qwen2": GQA,
    "qwen3": dict(GQA, head_dim=16),
    "phi3": GQA,
    "gemma2": dict(GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=2.0),
    "gemma3_text": dict(GEMMA, layer_types=["sliding_attention", "full_attention"]),
    "gpt_neox": {},
}
NO_SDPA = {"gemma2"}  # transformers' Gemma2 runs eager or flash attention only


def soft_capped(model) -> bool:
    """Whether the model's final logits are soft-capped (Gemma 2): not the LM head of the last hidden state."""
    return bool(ARCHITECTURES[model.causal_lm.config.model_type].get("final_logit_softcapping"))


def known(family: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return family in CONFIG_MAPPING


FAMILIES = [pytest.param(f, marks=pytest.mark.skipif(not known(f), reason=f"this transformers has no {f}"))
            for f in ARCHITECTURES]
_saved: dict[str, Path] = {}


def saved_model(family: str, root: Path, tokenizer) -> Path:
    """A folder holding a tiny random `family` model and the SmolLM2 tokenizer, made once per test session."""
    if family not in _saved:
        from transformers import AutoConfig, AutoModelForCausalLM

        ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = AutoConfig.for_model(family, vocab_size=len(tokenizer), **{**SHAPE, **ARCHITECTURES[family]}, **ids)
        torch.manual_seed(0)
        folder = root / family
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        _saved[family] = folder
    return _saved[family]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_model(request, tmp_path_factory, smol_tokenizer) -> Path:
    return saved_model(request.param, tmp_path_factory.getbasetemp(), smol_tokenizer)


@pytest.fixture(scope="module")
def hh_rows(shared_data, tmp_path_factory) -> Path:
    """The first 300 rows of hh-rlhf's helpful-base: what one step of each stage needs, read in a moment."""
    import gzip

    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    with gzip.open(shared_data / "helpful-base" / "test.jsonl.gz", "rt") as rows:
        path.write_text("".join(next(rows) for _ in range(300)))
    return path


def run_stage(stage: str, folder: Path, rows: Path, out: Path, *extra: str) -> None:
    """`trainer/STAGE.py` on the model in `folder` and the hh-rlhf `rows`, for one step, in this process."""
    import importlib

    from trainer.engine.launch import reset_accelerate

    reset_accelerate()
    try:
        importlib.import_module(f"trainer.{stage}").main([
            "--config", str(RECIPE / f"{stage}.yaml"), "--model_name_or_path", str(folder), "--dataset", str(rows),
            "--output_dir", str(out), "--max_steps", "1", "--eval_size", "0", *extra])
    finally:
        reset_accelerate()


def steps_logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def lora_b(adapter: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(adapter / "adapter_model.safetensors")).items() if "lora_B" in k}


SUPERVISED = ("--sft_size", "16", "--reward_size", "48", "--gradient_accumulation_steps", "1")


@pytest.fixture(scope="module")
def sft_and_reward(tiny_model, hh_rows, tmp_path_factory) -> tuple[Path, Path]:
    """The SFT and reward stages' run folders, one step each."""
    root = tmp_path_factory.mktemp(tiny_model.name)
    run_stage("sft", tiny_model, hh_rows, root / "sft", *SUPERVISED)
    run_stage("reward", tiny_model, hh_rows, root / "reward", *SUPERVISED)
    return root / "sft", root / "reward"


def test_one_sft_step_trains_the_policy_adapter(sft_and_reward):
    sft, _ = sft_and_reward
    (step,) = steps_logged(sft)
    assert math.isfinite(step["train/loss"]) and step["train/loss"] > 0 and step["train/grad_norm"] > 0
    assert all(b.abs().max() > 0 for b in lora_b(sft / "adapter").values())  # LoRA B starts at 0: trained


def test_one_reward_step_trains_the_reward_adapter_and_its_head(sft_and_reward):
    _, reward = sft_and_reward
    (step,) = steps_logged(reward)
    assert math.isfinite(step["train/loss"]) and 0 <= step["train/accuracy"] <= 1 and step["train/grad_norm"] > 0
    assert (reward / "adapter" / "head.safetensors").is_file()
    assert all(b.abs().max() > 0 for b in lora_b(reward / "adapter").values())


def test_one_ppo_step_moves_the_policy_off_the_sft_adapter(tiny_model, hh_rows, sft_and_reward, tmp_path):
    sft, reward = sft_and_reward
    run_stage("ppo", tiny_model, hh_rows, tmp_path / "ppo", "--sft_adapter", str(sft / "adapter"),
              "--reward_adapter", str(reward / "adapter"), "--rollout_batch_size", "4", "--ppo_epochs", "1",
              "--eval_prompts", "0")
    (step,) = steps_logged(tmp_path / "ppo")
    assert all(math.isfinite(step[k]) for k in ("loss/policy_avg", "loss/value_avg", "objective/kl",
                                                "objective/scores"))
    before, after = lora_b(sft / "adapter"), lora_b(tmp_path / "ppo" / "adapter")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


def test_one_grpo_step_trains_the_policy(tiny_model, hh_rows, sft_and_reward, tmp_path):
    _, reward = sft_and_reward
    run_stage("grpo", tiny_model, hh_rows, tmp_path / "grpo", "--reward_adapter", str(reward / "adapter"),
              "--eval_prompts", "0")
    (step,) = steps_logged(tmp_path / "grpo")
    assert all(math.isfinite(step[k]) for k in ("loss", "kl", "objective/scores")) and step["grad_norm"] > 0
    assert any(b.abs().max() > 0 for b in lora_b(tmp_path / "grpo" / "adapter").values())


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The model on the shared base with a policy adapter and a value adapter and head, both off the base (random
    LoRA), in eval mode, and three left-padded prompts of different lengths, longer than the sliding windows."""
    from foundation.settings import ModelArguments
    from trainer.model.loading import load_tokenizer
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    tok = load_tokenizer(str(tiny_model))
    args = ModelArguments(model_name_or_path=str(tiny_model), lora_r=4, lora_alpha=8, lora_dropout=0.0)
    specs = [AdapterSpec("policy", trainable=True), AdapterSpec("value", trainable=True, head=True)]
    model = build_shared_model(args, specs, vocab_size=len(tok), device=CPU)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    tok.padding_side = "left"
    texts = ["\n\nHuman: How do I bake bread?\n\nAssistant:", "\n\nHuman: Hi\n\nAssistant:",
             "\n\nHuman: What is the capital of France, and why is it there?\n\nAssistant:"]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return model.eval(), tok, batch["input_ids"], batch["attention_mask"]


def test_greedy_decoding_equals_transformers_generate(policy):
    from trainer.model.decode import Generator, Sampling
    from trainer.rl.rollout import sample_responses

    model, tok, ids, mask = policy
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    ours = sample_responses(Generator(model), ids, mask, greedy, tok.eos_token_id, tok.pad_token_id)[0]
    with torch.no_grad(), model.use_adapter("policy"):
        theirs = model.peft.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert ours.tolist() == theirs[:, : ours.shape[1]].tolist()
    assert len(set(ours[:, ids.shape[1]:].flatten().tolist())) > 3  # not one token over and over


def test_log_probs_stored_while_sampling_equal_a_scoring_pass(policy):
    from trainer.model.decode import Generator, Sampling
    from trainer.rl.rollout import sample_responses
    from trainer.rl.scoring import response_logprobs

    model, tok, ids, mask = policy
    sampling = Sampling(max_new_tokens=10, temperature=0.8)
    torch.manual_seed(0)
    ids, mask, response_mask, _, stored, _ = sample_responses(Generator(model), ids, mask, sampling, tok.eos_token_id,
                                                              tok.pad_token_id, with_logprobs=True)
    with torch.no_grad():
        scored, _ = response_logprobs(model, ids, mask, response_mask.shape[1], "policy", 0.8)
    assert response_mask.sum() >= 20
    torch.testing.assert_close(stored * response_mask, scored * response_mask, rtol=0, atol=2e-5)


def test_one_routed_pass_gives_what_one_pass_per_adapter_gives(policy):
    """PPO's scoring of a rollout: what the policy's log-probs are taken from and the value head's scores, from ONE
    pass of the base, each row group through its own LoRA - but where the logits are not the head of the last
    hidden state (Gemma 2's soft-cap), which asks for one pass each."""
    model, _, ids, mask = policy
    capped = soft_capped(model)
    outputs = (model.lm_output, "scores")
    assert outputs[0] == ("logits" if capped else "hidden")
    passes = []

    def one_pass_each():  # what `fused` promises: `logits`, `hidden_states` or `scores` of each adapter
        return [getattr(model, {"hidden": "hidden_states"}.get(output, output))(
            ids, mask, adapter, 6) for adapter, output in zip(["policy", "value"], outputs)]

    hook = model.causal_lm.get_decoder().register_forward_hook(lambda *_: passes.append(1))
    with torch.no_grad():
        routed = model.fused(ids, mask, ["policy", "value"], outputs, keep_last=6)
        apart = one_pass_each()
        with base_only(model):
            base = one_pass_each()
    hook.remove()
    assert len(passes) == (2 if capped else 1) + 2 + 2
    for got, expected, bare in zip(routed, apart, base):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert (got - bare).abs().max() > 1e-3  # each group went through its own adapter


def test_one_row_per_pair_scores_what_two_rows_per_pair_score(policy, hh_rows):
    """Reward and DPO batches with the prompt computed once give each completion's score and log-probs as a row
    of its own does - through sliding windows too, counted in the pair's positions; where the logits are
    soft-capped (Gemma 2) the batches are two rows per pair."""
    from foundation.settings import DataArguments
    from trainer.data.collators import PairCollator, SharedPromptPairCollator, pair_collator
    from trainer.data.hh_rlhf import load_pairs
    from trainer.data.tokenization import tokenize_pairs
    from trainer.dpo import sequence_logprobs
    from trainer.reward import pair_rewards

    model, tok, _, _ = policy
    args = DataArguments(dataset=str(hh_rows), max_length=64, min_prompt_tokens=4)
    examples = tokenize_pairs(load_pairs(args)[0][:12], tok, args)[0][:3]
    capped = soft_capped(model)
    assert isinstance(pair_collator(tok.pad_token_id, True, model), PairCollator if capped else SharedPromptPairCollator)
    if capped:
        return
    one, two = SharedPromptPairCollator(tok.pad_token_id)(examples), PairCollator(tok.pad_token_id)(examples)
    assert (one["segments"] == 0).sum(1).min() > 8  # prompts longer than the sliding windows
    with torch.no_grad():
        for shared, apart in ((pair_rewards(model, one, "value"), pair_rewards(model, two, "value")),
                              (sequence_logprobs(model, one, "policy"), sequence_logprobs(model, two, "policy"))):
            for got, expected in zip(shared, apart):
                torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)


def test_the_export_of_an_sft_adapter_computes_what_the_adapter_does(tiny_model, sft_and_reward, tmp_path):
    """The merged folder, loaded by plain transformers, gives the log-probs of the base with the adapter."""
    from transformers import AutoModelForCausalLM

    from foundation.settings import ModelArguments
    from trainer.export import main
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    sft, _ = sft_and_reward
    out = main(["--adapter", str(sft / "adapter"), "--out", str(tmp_path / "export")])
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    args = ModelArguments(model_name_or_path=str(tiny_model), lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model = build_shared_model(args, [AdapterSpec("policy", init_from=str(sft / "adapter"))], device=CPU).eval()
    ids = torch.randint(3, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.logits(ids, torch.ones_like(ids), "policy").log_softmax(-1)
        got = exported(ids).logits.log_softmax(-1)
        with base_only(model):
            base = model.logits(ids, torch.ones_like(ids), "policy").log_softmax(-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert (base - expected).abs().max() > 1e-3  # the adapter is in the export, not the base alone


FUSED = {"phi3": ("qkv_proj", "gate_up_proj"), "gpt_neox": ("query_key_value", "dense_h_to_4h")}  # one matrix each


def test_a_decode_s_dense_copies_multiply_each_sibling_group_as_one_matrix_as_its_layers_do(tiny_model, monkeypatch):
    """A 4-bit base decoding from dense copies (--generation_weights dequantized): q/k/v and gate/up, where the
    family keeps them apart, share one matrix, whose rows of each layer (the compiled step's product) give what
    the layer's own copy gives, biases too (Qwen2); a family that fuses them in its checkpoint has no group."""
    from foundation.settings import ModelArguments
    from trainer.model.decode_weights import DecodeWeights, DequantizedLinear
    from trainer.model.loading import load_base_model

    base = load_base_model(ModelArguments(model_name_or_path=str(tiny_model), quantization="nf4"), device=CPU)
    x = torch.randn(3, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with DecodeWeights(base, "dequantized").dense():
        copies = {name.rpartition(".")[2]: m for name, m in base.named_modules() if isinstance(m, DequantizedLinear)}
        grouped = {name for name, m in copies.items() if m.group is not None}
        own = {name: copies[name](x.to(copies[name].dtype)) for name in grouped}
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            for name in grouped:
                assert torch.equal(copies[name](x.to(copies[name].dtype)), own[name]), name
    family = tiny_model.name
    assert grouped == (set() if family in FUSED else {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
    assert set(FUSED.get(family, ())) <= set(copies)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_auto_is_what_the_architecture_supports_said_in_one_line(family, tmp_path_factory,
                                                                           smol_tokenizer, caplog):
    from foundation.settings import ModelArguments
    from trainer.model.loading import load_base_model

    folder = saved_model(family, tmp_path_factory.getbasetemp(), smol_tokenizer)
    with caplog.at_level(logging.INFO, logger="trainer.model.loading"):
        model = load_base_model(ModelArguments(model_name_or_path=str(folder)), device=CPU)
    chosen = "eager" if family in NO_SDPA else "sdpa"
    assert model.config._attn_implementation == chosen
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention auto")]
    name = type(model).__name__
    why = f"{name} does not support sdpa" if chosen == "eager" else "flash_attention_2 unavailable (no CUDA device)"
    assert len(said) == 1 and said[0].startswith(f"attention auto -> {chosen}: {why}"), said


def test_an_attention_the_architecture_lacks_is_refused_in_one_line(tmp_path_factory, smol_tokenizer, hh_rows,
                                                                    tmp_path, capsys):
    from foundation.cli import run

    folder = saved_model("gemma2", tmp_path_factory.getbasetemp(), smol_tokenizer)
    with pytest.raises(SystemExit) as exit_info:
        run(lambda argv: run_stage("sft", folder, hh_rows, tmp_path / "run", *argv), ["--attn_implementation", "sdpa"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == ("error: --attn_implementation sdpa: Gemma2ForCausalLM does not support sdpa; use auto "
                       "(picks what it supports) or eager")
    assert not (tmp_path / "run" / "adapter").exists()


class Architecture:
    """A stand-in for a transformers model class: only its attention support flags are read."""

    def __init__(self, name: str, flash: bool, sdpa: bool):
        self.__name__, self._supports_flash_attn, self._supports_sdpa = name, flash, sdpa


@pytest.mark.parametrize("flash_installed, flash, sdpa, device, chosen, why", [
    (True, True, True, "cuda", "flash_attention_2", "flash-attn is installed and Arch supports it"),
    (True, False, True, "cuda", "sdpa", "flash_attention_2 unavailable (Arch does not support flash_attention_2)"),
    (False, True, True, "cuda", "sdpa", "flash_attention_2 unavailable (flash-attn is not installed"),
    (True, True, True, "cpu", "sdpa", "flash_attention_2 unavailable (no CUDA device)"),
    (True, True, False, "cpu", "eager", "Arch does not support sdpa (flash_attention_2: no CUDA device)"),
])
def test_attention_auto_prefers_flash_then_sdpa_then_eager(flash_installed, flash, sdpa, device, chosen, why,
                                                           monkeypatch, caplog):
    import importlib.util

    from trainer.model.loading import pick_attention

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if flash_installed else None) if name == "flash_attn"
                        else real(name, *a))
    with caplog.at_level(logging.INFO, logger="trainer.model.loading"):
        assert pick_attention("auto", torch.device(device), Architecture("Arch", flash, sdpa)) == chosen
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"attention auto -> {chosen}: {why}"), said


def test_an_explicit_flash_attention_the_architecture_lacks_is_refused():
    from foundation.cli import UsageError
    from trainer.model.loading import pick_attention

    with pytest.raises(UsageError, match="--attn_implementation flash_attention_2: Arch does not support"):
        pick_attention("flash_attention_2", torch.device("cuda"), Architecture("Arch", False, True))
    assert pick_attention("eager", CPU, Architecture("Arch", False, False)) == "eager"
