"""Base loading: the embedded SmolLM2 (real, offline), presets, 4-bit NF4 on CPU, attention choice."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from foundation.cli import UsageError
from foundation.settings import DataArguments, ModelArguments
from profiling.shapes import KNOWN_MODELS, load_shape, preset_config
from trainer.data.hh_rlhf import load_pairs
from trainer.model.loading import (
    ModelLoadError, embedded_model_dir, load_base_model, load_tokenizer, pick_attention, resolve_precision,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def real_batch(shared_data, smol_tokenizer):
    """Eight real hh-rlhf chosen dialogues, tokenized to at most 128 tokens."""
    pairs, _ = load_pairs(DataArguments(dataset=str(shared_data / "helpful-base")))
    texts = [p.prompt + p.chosen for p in pairs[:8]]
    enc = smol_tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=128)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    return enc.input_ids, enc.attention_mask, labels


def perplexity(model, batch) -> float:
    ids, mask, labels = batch
    with torch.no_grad():
        return math.exp(model(input_ids=ids, attention_mask=mask, labels=labels).loss.item())


def test_embedded_smollm2_is_a_real_pretrained_model_offline(real_batch, smol_tokenizer):
    args = ModelArguments(model_name_or_path="smollm2-135m", quantization="none", gradient_checkpointing=False)
    model = load_base_model(args, device=CPU)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert all(not p.requires_grad for p in model.parameters())
    pretrained = perplexity(model, real_batch)
    # Same architecture, random weights: near-uniform over a 49k vocabulary.
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(model.config)
    random_ppl = perplexity(random_model, real_batch)
    assert pretrained < 60, pretrained
    assert random_ppl > 10_000, random_ppl
    assert random_ppl / pretrained > 500


def test_embedded_conversion_is_cached_as_safetensors():
    first = embedded_model_dir()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert embedded_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(first.glob("*.bin")) and not list(first.glob("*.gguf"))


def test_4bit_nf4_path_runs_on_cpu_close_to_full_precision(real_batch):
    import bitsandbytes as bnb

    full = load_base_model(ModelArguments(quantization="none", gradient_checkpointing=False), device=CPU)
    nf4 = load_base_model(ModelArguments(quantization="nf4", gradient_checkpointing=False), device=CPU)
    linear4 = [m for m in nf4.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 30 * 7  # q, k, v, o, gate, up, down in every layer; lm_head stays full precision
    assert linear4[0].weight.quant_type == "nf4" and linear4[0].weight.quant_state.nested  # double quantization
    assert nf4.dtype == torch.bfloat16
    # Four rows of 64 tokens: bitsandbytes' CPU 4-bit matmuls are slow, and this is plenty to compare.
    small = tuple(t[:4, :64] for t in real_batch)
    ppl_full, ppl_nf4 = perplexity(full, small), perplexity(nf4, small)
    assert abs(math.log(ppl_nf4) - math.log(ppl_full)) < 0.1 * math.log(ppl_full), (ppl_full, ppl_nf4)


def test_presets_build_the_named_architectures():
    cfg = preset_config("llama-2-7b", vocab_size=49152)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (4096, 32, 32000)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert 6.7e9 < n < 6.8e9  # Llama-2-7B has 6.74B parameters
    tiny = preset_config("tiny-llama", vocab_size=512, overrides="num_hidden_layers=3,hidden_size=32")
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.vocab_size) == (3, 32, 512)
    with pytest.raises(UsageError, match="'not_a_field' is not a LlamaConfig field"):
        preset_config("tiny-llama", vocab_size=512, overrides="not_a_field=3")
    with pytest.raises(UsageError, match="is not key=value"):
        preset_config("tiny-llama", vocab_size=512, overrides="num_hidden_layers")


@pytest.mark.parametrize("name, config_class, billions, kv_heads, vocab", [
    ("llama-3.1-8b", "LlamaConfig", 8.03, 8, 128256),  # published sizes: 8.03B, 7.62B, 7.25B parameters
    ("qwen2.5-7b", "Qwen2Config", 7.62, 4, 152064),
    ("mistral-7b", "MistralConfig", 7.25, 8, 32768),
])
def test_model_family_presets_have_the_real_shapes_and_the_estimator_counts_every_weight(name, config_class, billions,
                                                                                         kv_heads, vocab):
    from transformers import AutoModelForCausalLM

    cfg = preset_config(name, vocab_size=49152)  # the borrowed tokenizer does not shrink a real vocabulary
    assert type(cfg).__name__ == config_class and cfg.vocab_size == vocab and cfg.num_key_value_heads == kv_heads
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    built = sum(p.numel() for p in model.parameters())
    shape = load_shape(name)
    assert shape.total_params() == built  # biases (Qwen2's q/k/v), GQA and untied embeddings included
    assert round(built / 1e9, 2) == billions
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    assert shape.bias_params() == biases and (biases > 0) == (name == "qwen2.5-7b")


def test_the_estimator_sizes_several_models_in_one_table(capsys):
    from profiling.estimate import main

    main(["--models", "llama-2-7b,llama-3.1-8b,qwen2.5-7b,mistral-7b", "--stage", "ppo"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "B |" in line]
    assert [r.split(" | ")[0][2:] for r in rows] == ["llama-2-7b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b"]
    assert "| 8/32 | 128,256 |" in rows[1] and "| 4/28 | 152,064 |" in rows[2]


def test_the_estimators_shape_of_the_embedded_model_is_its_real_config():
    """The estimator sizes smollm2-135m from a table (no conversion needed): it must match the model."""
    import json

    config = json.loads((embedded_model_dir() / "config.json").read_text())
    for key, value in KNOWN_MODELS["smollm2-135m"].items():
        assert config[key] == value, key
    shape = load_shape("smollm2-135m")
    assert (shape.num_layers, shape.num_kv_heads, shape.tie_word_embeddings) == (30, 3, True)


def test_unknown_model_name_fails_with_what_to_use(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model 'llama-3-9000'"):
        load_base_model(ModelArguments(model_name_or_path="llama-3-9000"), device=CPU)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_base_model(ModelArguments(model_name_or_path=str(tmp_path / "empty")), device=CPU)
    with pytest.raises(UsageError, match="--quantization 'int3': must be one of auto, nf4, none"):
        ModelArguments(model_name_or_path="tiny-llama", quantization="int3")


def test_tiny_nf4_model_evaluates_on_cpu_with_the_standard_weight_layout():
    """bitsandbytes would repack the weights in place on AVX512-BF16 CPUs at the first no-grad eval forward,
    and assert on the tiny preset's 172-wide MLP; the loader keeps the standard NF4 layout instead."""
    import bitsandbytes as bnb

    model = load_base_model(ModelArguments(model_name_or_path="tiny-llama", quantization="nf4"), vocab_size=64,
                            device=CPU).eval()
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert any(m.out_features % 32 for m in layers)  # the shape the repacking rejects is present
    before = {id(m): (m.weight.data_ptr(), tuple(m.weight.shape)) for m in layers}
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 64, (2, 8))).logits
    assert torch.isfinite(logits).all()
    assert all(not m.support_avx512bf16_for_cpu for m in layers)
    assert {id(m): (m.weight.data_ptr(), tuple(m.weight.shape)) for m in layers} == before


def test_quantization_auto_is_full_precision_without_cuda_and_nf4_computes_in_bf16():
    def precision(quantization, dtype="auto"):
        return resolve_precision(ModelArguments(quantization=quantization, dtype=dtype), CPU)

    assert precision("auto") == (False, torch.float32)
    assert precision("nf4") == (True, torch.bfloat16)  # fp32 compute would only double the dequantization
    assert precision("none", "bfloat16") == (False, torch.bfloat16)


def test_one_precision_and_optimizer_rule_for_trainer_estimator_and_benchmarks():
    """The estimator resolves 'auto' settings with the same functions the trainer loads with."""
    from profiling import resolve
    from profiling.predict import EstimateArguments

    assert resolve.four_bit("auto", "cuda") and not resolve.four_bit("auto", "cpu")
    assert resolve.compute_dtype("auto", "cuda", nf4=True, bf16_supported=False) == "float16"
    assert resolve.optimizer("auto", "cuda") == "paged_adamw_8bit" and resolve.optimizer("auto", "cpu") == "adamw_torch"
    assert resolve.optimizer("paged_adamw_8bit", "cpu") == "adamw_8bit"
    est = EstimateArguments(model_name_or_path="tiny-llama", quantization="auto", dtype="auto", optimizer="auto",
                            device="cpu").resolved()
    four_bit, dtype = resolve_precision(ModelArguments(quantization="auto", dtype="auto"), CPU)
    assert (est.quantization == "nf4", est.dtype) == (four_bit, str(dtype).removeprefix("torch."))
    assert est.optimizer == "adamw_torch"


def test_attention_falls_back_from_flash_attention_with_a_logged_reason(caplog):
    with caplog.at_level(logging.INFO, logger="trainer.model.loading"):
        assert pick_attention("flash_attention_2", CPU) == "sdpa"
    assert "flash_attention_2 unavailable: no CUDA device" in caplog.text
    assert pick_attention("auto", CPU) == "sdpa"
    assert pick_attention("eager", CPU) == "eager"
    with pytest.raises(ModelLoadError):
        pick_attention("xformers", CPU)


def test_gradient_checkpointing_uses_the_transformers_5_api():
    model = load_base_model(ModelArguments(model_name_or_path="tiny-llama", gradient_checkpointing=True),
                            vocab_size=64, device=CPU)
    assert model.is_activation_checkpointing
    assert model.config._attn_implementation == "sdpa"
    off = load_base_model(ModelArguments(model_name_or_path="tiny-llama", gradient_checkpointing=False),
                          vocab_size=64, device=CPU)
    assert not off.is_activation_checkpointing


def test_checkpointing_a_model_without_input_embeddings_hooks_nothing(monkeypatch):
    """A model whose `get_input_embeddings` is not implemented (remote code) is checkpointed all the same, with no
    input hook (transformers' own skips it too)."""
    from trainer.model.loading import enable_checkpointing

    model = load_base_model(ModelArguments(model_name_or_path="tiny-llama", gradient_checkpointing=False),
                            vocab_size=64, device=CPU)

    def not_implemented(self):
        raise NotImplementedError

    monkeypatch.setattr(type(model), "get_input_embeddings", not_implemented)
    enable_checkpointing(model)
    assert model.is_activation_checkpointing
    assert not model.model.embed_tokens._forward_hooks


def test_tokenizer_of_a_preset_is_smollm2s_with_a_pad_token():
    tok = load_tokenizer("tiny-llama")
    assert len(tok) == 49152 and tok.pad_token is not None


def test_a_preset_with_a_smaller_vocabulary_folds_the_borrowed_tokenizer():
    tok = load_tokenizer("llama-2-7b")
    assert len(tok) == 32000
    ids = tok(["\n\nHuman: hello there\n\nAssistant: General Kenobi"], add_special_tokens=False)["input_ids"][0]
    smol = load_tokenizer("tiny-llama")  # the borrowed tokenizer, its 49,152 tokens unfolded
    raw = smol(["\n\nHuman: hello there\n\nAssistant: General Kenobi"], add_special_tokens=False)["input_ids"][0]
    assert ids == [i % 32000 for i in raw] and max(ids) < 32000 and max(raw) >= 32000
    assert tok.eos_token_id == smol.eos_token_id % 32000 and tok.pad_token_id < 32000
    assert len(load_tokenizer("tiny-llama")) == 49152  # presets without a vocabulary size keep the tokenizer's


def test_an_exported_tokenizer_folder_stands_in_for_the_embedded_package(tmp_path):
    load_tokenizer("smollm2-135m").save_pretrained(tmp_path / "tok")
    tok = load_tokenizer("llama-2-7b", tokenizer_name_or_path=str(tmp_path / "tok"))
    assert len(tok) == 32000 and tok("Human: hi")["input_ids"] == load_tokenizer("llama-2-7b")("Human: hi")["input_ids"]


@pytest.mark.parametrize("family, model_class", [("llama-3.1-8b", "LlamaForCausalLM"), ("qwen2.5-7b", "Qwen2ForCausalLM"),
                                                 ("mistral-7b", "MistralForCausalLM")])
def test_each_family_preset_trains_an_adapter_on_the_shared_base(family, model_class):
    """A family preset shrunk by --preset_overrides builds, routes adapters and takes a gradient step."""
    from foundation.settings import ModelArguments
    from trainer.model.loading import load_tokenizer
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    small = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2," \
            "vocab_size=512"
    args = ModelArguments(model_name_or_path=family, preset_overrides=small, quantization="none", lora_r=4,
                          lora_alpha=8, lora_dropout=0.0)
    tok = load_tokenizer(family, small)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True), AdapterSpec("reference")],
                               vocab_size=len(tok))
    assert type(model.peft.base_model.model).__name__ == model_class
    ids = torch.randint(0, 512, (2, 12))
    logits = model(ids, torch.ones_like(ids), adapter="policy")
    logits.float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.trainable_parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_a_host_embedding_gives_the_same_rows_forward_and_in_generation_and_holds_no_parameter():
    """--offload_embeddings' module (on a GPU its matrix sits in pinned host memory, its rows go to the card):
    the same hidden states and greedy tokens as the embedding it replaces, and nothing `.to()` would move."""
    from trainer.model.loading import HostEmbedding

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", gradient_checkpointing=False)
    model = load_base_model(args, vocab_size=512, device=CPU).eval()
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        host = HostEmbedding(model.get_input_embeddings(), CPU)
        model.set_input_embeddings(host)
        assert list(host.parameters()) == [] and model.get_input_embeddings().weight is host.host_weight
        model.to(CPU)
        assert torch.equal(model(ids).logits, before)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)


def test_offload_embeddings_refuses_a_tied_model_and_is_ignored_on_the_cpu(caplog):
    from trainer.model.loading import offload_input_embeddings_

    untied = load_base_model(ModelArguments(model_name_or_path="tiny-llama", quantization="none"), 512, CPU)
    with caplog.at_level(logging.INFO, logger="trainer.model.loading"):
        assert offload_input_embeddings_(untied, CPU) is False
    assert "offload_embeddings ignored: the model is on cpu" in caplog.text
    tied = load_base_model(ModelArguments(model_name_or_path="tiny-llama", quantization="none",
                                          preset_overrides="tie_word_embeddings=true"), 512, CPU)
    with pytest.raises(UsageError, match="ties its input embedding to the LM head"):
        offload_input_embeddings_(tied, CPU)


def _checkpointed_policy(offload: bool = False):
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", gradient_checkpointing=True,
                          lora_r=8, lora_alpha=16, lora_dropout=0.0, offload_activations=offload)
    return build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=512).train()


def test_offloaded_activations_are_what_checkpointing_keeps_and_change_no_gradient(monkeypatch):
    """--offload_activations' hooks (trainer/model/offload.py), made to take CPU tensors for CUDA ones: with
    checkpointing they move what the estimator says the update keeps (each layer's input, the final norm's
    input and rsqrt) and the LM head's inputs, never a weight; the gradients are the same to the bit."""
    from dataclasses import replace

    from profiling import activations as A
    from profiling.predict import EstimateArguments, forward_spec, resolve_shape
    from trainer.model.offload import SavedToHost

    model = _checkpointed_policy()
    b, t, h = 2, 16, 64
    ids = torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(0))

    def grads(hooks):
        model.zero_grad(set_to_none=True)
        with hooks:
            loss = model(ids, torch.ones_like(ids), adapter="policy", output="logprobs", labels=ids).sum()
        loss.backward()
        return [p.grad.clone() for p in model.trainable_parameters()]

    offloader = SavedToHost(model.parameters(), min_bytes=0)
    monkeypatch.setattr(SavedToHost, "offloads",
                        lambda self, x: x.untyped_storage().data_ptr() not in self._weights)
    plain = grads(torch.enable_grad())
    moved = grads(offloader.hooks())
    assert all(torch.equal(x, y) for x, y in zip(plain, moved))
    estimate = EstimateArguments(model_name_or_path="tiny-llama", stage="sft", quantization="none", dtype="float32",
                                 lora_r=8, lora_dropout=0.0, device="cpu", vocab_size=512)
    spec = replace(forward_spec(estimate.resolved(), 4), offload=True)
    _, _, host = A.training_parts(resolve_shape(estimate), spec, b * t, t)
    positions = b * (t - 1)  # the LM head's: the labelled positions' mask, hidden states, labels, log-sum-exp
    assert offloader.bytes == host + positions * (1 + 4 * h + 8 + 4)


def test_offload_activations_is_ignored_on_the_cpu_and_refused_with_compiled_layers(caplog, tmp_path):
    from trainer.engine.setup import start_run
    from trainer.sft import SFTArguments

    with caplog.at_level(logging.INFO, logger="trainer.model.shared_base"):
        model = _checkpointed_policy(offload=True)
    assert model.saved_to_host is None and "offload_activations ignored" in caplog.text
    with pytest.raises(UsageError, match="--offload_activations and --compile_layers do not combine"):
        start_run(SFTArguments, ["--config", "tests/configs/tiny_sft.yaml", "--output_dir", str(tmp_path / "x"),
                                 "--offload_activations", "true", "--compile_layers", "true"], stage="sft")
