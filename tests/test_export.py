"""`python -m trainer.export`: a policy adapter merged into a standalone Hugging Face model folder that
plain transformers loads, with no project code importable, and that computes the adapter model's
log-probs; with `--format gguf`, a GGUF file that transformers' GGUF loader reads back to the merged
model's logits, tokenizer and chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_only

ROOT = Path(__file__).resolve().parent.parent
TEXT = "\n\nHuman: How do I bake bread?\n\nAssistant: Mix flour, water and yeast, then bake it."

# Run in a fresh interpreter: `trainer` and `profiling` cannot be imported, so only transformers reads the folder.
PLAIN = r'''
import importlib.abc, importlib.machinery, json, sys
class Refuse(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any import of the project or of PEFT fails (a probe for whether one is installed still works)."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trainer", "profiling", "peft"):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ImportError(f"{spec.name} must not be needed to load the export")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Refuse())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, text = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
with torch.no_grad():
    logprobs = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    generated = model.generate(ids[:, :12], max_new_tokens=6, do_sample=False)
print(json.dumps({"logprobs": logprobs.tolist(), "new_tokens": generated.shape[1] - 12}))
'''


def saved_policy(folder: Path, model_args, seed: int = 0) -> tuple[Path, object]:
    """A policy adapter that really changes the model (random LoRA B), saved as a stage saves it."""
    from dataclasses import asdict

    from trainer.model.loading import load_tokenizer, model_plan
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    tok = load_tokenizer(model_args.model_name_or_path)
    model = build_shared_model(model_args, [AdapterSpec("policy", trainable=True)], vocab_size=len(tok))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name and ".policy." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    out = model.save_adapter("policy", folder)
    plan = model_plan(model_args, torch.device("cpu"))
    trained_on = {"quantization": plan.quantization, "dtype": plan.dtype}
    (out / "base_model.json").write_text(json.dumps({**asdict(model_args), "trained_on": trained_on}))
    return out, model.eval()


def adapter_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids, torch.ones_like(ids), adapter="policy")[0]
    return logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def plain_load(out: Path, tmp_path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", PLAIN, str(out), TEXT], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_exported_smollm2_policy_loads_with_plain_transformers_and_matches_the_adapter(tmp_path, smol_tokenizer):
    from foundation.settings import ModelArguments
    from trainer.export import main

    args = ModelArguments(model_name_or_path="smollm2-135m", quantization="none", lora_r=8, lora_alpha=16,
                          lora_dropout=0.0)
    adapter, model = saved_policy(tmp_path / "adapter", args)
    out = main(["--adapter", str(adapter), "--out", str(tmp_path / "export")])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "generation_config.json").is_file() and not (out / "adapter_config.json").exists()
    plain = plain_load(out, tmp_path)
    ids = smol_tokenizer(TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"]
    expected = adapter_logprobs(model, ids)
    got = torch.tensor(plain["logprobs"])
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    with torch.no_grad(), base_only(model):  # the adapter really moved the model: the export is not the base
        base_logits = model.peft(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    base_lp = base_logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    assert (base_lp - expected).abs().max() > 1e-2
    assert plain["new_tokens"] == 6


def test_an_nf4_trained_adapter_exports_the_base_it_was_trained_against(tmp_path):
    """The 4-bit base computes with the NF4 round trip of its weights (in bf16): the export's weights are
    exactly those plus the LoRA update, and its log-probs are closer to the trained model's than a merge
    into the unrounded weights."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from foundation.settings import ModelArguments
    from trainer.export import main
    from trainer.model.loading import load_tokenizer

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="nf4", lora_r=4, lora_alpha=8,
                          lora_dropout=0.0)
    adapter, model = saved_policy(tmp_path / "adapter", args)
    assert json.loads((adapter / "base_model.json").read_text())["trained_on"] == {"quantization": "nf4",
                                                                                   "dtype": "bfloat16"}
    tok = load_tokenizer("tiny-llama")
    ids = tok(TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"]
    expected = adapter_logprobs(model, ids)
    errors, outs = {}, {}
    for rounding in ("true", "false"):  # loaded here: plain loading is the SmolLM2 export's test
        outs[rounding] = main(["--adapter", str(adapter), "--out", str(tmp_path / f"export-{rounding}"),
                               "--nf4_rounding", rounding, "--dtype", "float32"])
        exported = AutoModelForCausalLM.from_pretrained(outs[rounding], dtype=torch.float32).eval()
        with torch.no_grad():
            got = exported(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        errors[rounding] = (got - expected.float()).abs().max().item()
    assert errors["true"] < errors["false"], errors

    layer = "model.layers.0.self_attn.q_proj"
    exported = load_file(str(outs["true"] / "model.safetensors"))[f"{layer}.weight"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    a, b = (lora[f"base_model.model.{layer}.lora_{x}.weight"] for x in "AB")
    nf4 = dict(model.peft.named_modules())[f"base_model.model.{layer}.base_layer"].weight
    base = F.dequantize_4bit(nf4.data, nf4.quant_state).reshape(exported.shape).float()
    assert torch.allclose(exported, base + (b @ a) * (8 / 4), atol=1e-6)


def test_a_reward_adapter_or_a_used_folder_is_refused_in_one_line(tmp_path, capsys):
    from foundation.cli import run
    from trainer.export import main

    reward = tmp_path / "reward"
    reward.mkdir()
    (reward / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (reward / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    (reward / "head.safetensors").write_bytes(b"\0" * 8)
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    for argv, code, text in [
        (["--adapter", str(reward), "--out", str(tmp_path / "o")], 1, "a reward adapter"),
        (["--adapter", str(reward), "--out", str(used)], 1, "a reward adapter"),
        (["--out", str(used)], 2, "usage: python -m trainer.export"),
        (["--adapter", str(reward), "--out", str(tmp_path / "o"), "--dtype", "int8"], 2, "--dtype 'int8'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            run(main, argv)
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert exit_info.value.code == code and len(err) == 1 and text in err[0], (argv, err)
    assert not (tmp_path / "o").exists()


def test_an_out_link_or_an_unwritable_place_is_refused_before_the_export_starts(tmp_path, capsys, monkeypatch):
    """--out at a symbolic link (to an empty folder, or dangling), or where nothing can be written (a read-only
    or full filesystem), is one line before any model loads (it was found only after the whole export)."""
    import errno

    import foundation.files
    import trainer.export
    from foundation.cli import run
    from trainer.export import main

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (policy / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    monkeypatch.setattr(trainer.export, "base_model_args", lambda *a, **k: pytest.fail("the export started"))
    empty, link, dangling = tmp_path / "empty", tmp_path / "link", tmp_path / "dangling"
    empty.mkdir()
    link.symlink_to(empty)
    dangling.symlink_to(tmp_path / "nowhere")

    def refused(out, text):
        with pytest.raises(SystemExit) as exit_info:
            run(main, ["--adapter", str(policy), "--out", str(out)])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert exit_info.value.code == 2 and len(err) == 1 and text in err[0], err

    refused(link, f"--out {link}: is a symbolic link")
    refused(dangling, f"--out {dangling}: is a symbolic link")
    for code, reason in ((errno.EROFS, "Read-only file system"), (errno.ENOSPC, "No space left on device")):
        def failing(*args, code=code, reason=reason, **kwargs):
            raise OSError(code, reason)

        with monkeypatch.context() as patch:
            patch.setattr(foundation.files.tempfile, "mkstemp", failing)
            refused(tmp_path / "new", f"--out {tmp_path / 'new'}: cannot write in {tmp_path} ({reason})")
    assert not (tmp_path / "new").exists() and not (tmp_path / "nowhere").exists() and not any(empty.iterdir())


def test_a_disk_that_fills_while_exporting_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from transformers import PreTrainedModel

    from foundation.cli import run
    from foundation.settings import ModelArguments
    from trainer.export import main

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", lora_r=4, lora_alpha=8,
                          lora_dropout=0.0)
    adapter, _ = saved_policy(tmp_path / "adapter", args)

    def full(self, folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 64)  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as exit_info:
        run(main, ["--adapter", str(adapter), "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: --out {out}: could not be written (No space left on device; ")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".exported")] == []


def test_an_out_folder_filled_while_exporting_is_left_as_it_is_and_refused_in_one_line(tmp_path, capsys,
                                                                                        monkeypatch):
    """--out was empty at the start; another program writes there while the base loads: the export is not
    published over it, the file stays, and no temporary folder is left behind."""
    import trainer.export
    from foundation.cli import run
    from foundation.settings import ModelArguments

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", lora_r=4, lora_alpha=8,
                          lora_dropout=0.0)
    adapter, _ = saved_policy(tmp_path / "adapter", args)
    out = tmp_path / "out"
    out.mkdir()
    load = trainer.export.load_base_model

    def load_while_someone_writes(*a, **kw):
        (out / "theirs.txt").write_text("keep me")
        return load(*a, **kw)

    monkeypatch.setattr(trainer.export, "load_base_model", load_while_someone_writes)
    with pytest.raises(SystemExit) as exit_info:
        run(trainer.export.main, ["--adapter", str(adapter), "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2
    assert err == [f"error: --out {out}: exists and is not an empty folder (it was filled while exporting; left as "
                   "it is); pick a new one"]
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and (out / "theirs.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out"]


def test_an_empty_out_folder_becomes_the_export(tmp_path):
    from foundation.settings import ModelArguments
    from trainer.export import main

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", lora_r=4, lora_alpha=8,
                          lora_dropout=0.0)
    adapter, _ = saved_policy(tmp_path / "adapter", args)
    (tmp_path / "out").mkdir()
    out = main(["--adapter", str(adapter), "--out", str(tmp_path / "out")])
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "export.json").read_text())["base"] == "tiny-llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_holding_nan_or_inf_is_refused_in_one_line_naming_the_tensor_and_nothing_is_written(
        tmp_path, capsys, bad):
    from safetensors.torch import load_file, save_file

    from foundation.cli import run
    from foundation.settings import ModelArguments
    from trainer.export import main

    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", lora_r=4, lora_alpha=8,
                          lora_dropout=0.0)
    adapter, _ = saved_policy(tmp_path / "adapter", args)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = sorted(k for k in tensors if "lora_B" in k)[-1]
    tensors[key][0, 0] = bad
    save_file(tensors, str(weights))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run(main, ["--adapter", str(adapter), "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1
    assert err == [f"error: --adapter: {weights} holds NaN or inf values in {key}: the adapter is unusable (its "
                   "training diverged); export an earlier checkpoint's adapter"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


# ---- GGUF (--format gguf) ------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DIGITS = "Bake it 1234567890 times, <think> then rest."
TOKENIZER_KIND = {"llama": ["gpt2", "gpt-2"], "qwen2": ["gpt2", "qwen2"], "mistral": ["llama", "default"]}
CORPUS = [TEXT, "Human: What is the capital of France? Assistant: Paris is the capital of France.",
          "The quick brown fox jumps over the lazy dog 1234567890 times, then <think> rests."]


def small_tokenizer(folder: Path, kind: str) -> Path:
    """A BPE tokenizer of a few hundred tokens trained on CORPUS, with ChatML specials, a non-special added token
    and CHAT_TEMPLATE: byte-level (GPT-2 split), qwen2 (Qwen2's split, no BOS) or sentencepiece (byte fallback,
    BOS added, as Llama 2 and Mistral). Small because GGUF readers parse every token in Python."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

    spm = kind == "sentencepiece"
    trainer = Tokenizer(models.BPE())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace() if spm else pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=360, show_progress=False, initial_alphabet=[] if spm else pre_tokenizers.ByteLevel.alphabet()))
    learned = json.loads(trainer.to_str())["model"]
    firsts = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] if spm else ["<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(firsts)}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    if spm:
        tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    elif kind == "qwen2":
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>")
    else:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      unk_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def tiny_base(tmp_path: Path, arch: str):
    """ModelArguments of a tiny base: llama, the tiny-llama preset with a byte-level tokenizer; mistral, the
    mistral-7b preset shrunk, with a SentencePiece tokenizer; qwen2, a saved folder with random q/k/v biases,
    tied embeddings and 20 embedding rows past its tokenizer's tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from foundation.settings import ModelArguments

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    lora = dict(quantization="none", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    if arch == "llama":
        tok = small_tokenizer(tmp_path / "tokenizer", "byte_level")
        return ModelArguments(model_name_or_path="tiny-llama", tokenizer_name_or_path=str(tok), **lora)
    if arch == "mistral":
        tok = small_tokenizer(tmp_path / "tokenizer", "sentencepiece")
        rows = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]) + 3  # + ChatML, <think>
        return ModelArguments(model_name_or_path="mistral-7b", tokenizer_name_or_path=str(tok),
                              preset_overrides=",".join(f"{k}={v}" for k, v in small.items()) + f",vocab_size={rows}",
                              **lora)
    folder = small_tokenizer(tmp_path / "qwen2", "qwen2")
    rows = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3 + 20
    config = AutoConfig.for_model("qwen2", **small, vocab_size=rows, tie_word_embeddings=True,
                                  max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return ModelArguments(model_name_or_path=str(folder), **lora)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()


def rounded_like(model, gguf_type: str):
    """A copy of a float32 model with every matrix rounded as the GGUF type stores it (norms and biases stay
    float32): f16 and bf16 by torch's round-to-nearest-even, Q8_0 through the gguf package (matrices whose rows
    are not whole 32-value blocks in f16, as the export writes them)."""
    import copy

    import gguf

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.ndim != 2 or gguf_type == "f32":
                continue
            if gguf_type == "bf16":
                p.copy_(p.bfloat16().float())
            elif gguf_type == "q8_0" and p.shape[-1] % 32 == 0:
                q8 = gguf.GGMLQuantizationType.Q8_0
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))
            else:
                p.copy_(p.half().float())
    return rounded


@pytest.mark.parametrize("arch,gguf_types", [("llama", ("f32", "f16", "bf16", "q8_0")), ("qwen2", ("f16", "q8_0")),
                                             ("mistral", ("f32", "bf16"))], ids=["llama", "qwen2", "mistral"])
def test_a_gguf_export_reads_back_in_transformers_with_the_merged_models_logits_and_tokenizer(tmp_path, arch,
                                                                                              gguf_types):
    """transformers' GGUF loader reads each --gguf_type back, with the tokenizer and chat template.

    Its logits equal those of the merged model with its matrices rounded as the type stores them, to float32
    summation order (1e-5): every weight is in its place (names, the llama Q/K row order, tied embeddings,
    biases). Against the unrounded merged folder f32 is exact; the other types move the logits by their
    rounding. With eps the largest relative change (Frobenius) the type makes to any of the M matrices (f16
    ~2e-4, bf16 ~1.7e-3, Q8_0 ~5.5e-3), each matrix moves the logits by about eps of their size and M
    independent roundings add in quadrature: |dlogit| <~ sqrt(M) * eps * max|logit|. The bound is twice that
    (f16 ~1.2e-3 here)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.export import main

    adapter, _ = saved_policy(tmp_path / "adapter", tiny_base(tmp_path, arch))
    hf = main(["--adapter", str(adapter), "--out", str(tmp_path / "hf"), "--dtype", "float32"])
    merged = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    want = logits_of(merged, ids)
    chat = [{"role": "user", "content": "How do I bake bread?"}]
    matrices = [p for p in merged.parameters() if p.ndim == 2]
    for gguf_type in gguf_types:
        out = main(["--adapter", str(adapter), "--out", str(tmp_path / gguf_type), "--format", "gguf",
                    "--gguf_type", gguf_type])
        assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "export.json", "model.gguf"]
        assert (out / "Modelfile").read_text() == "FROM ./model.gguf\n"
        if (arch, gguf_type) == ("llama", "q8_0"):  # tiny-llama's down_proj rows (172) are not whole 32-value blocks
            assert json.loads((out / "export.json").read_text())["tensors"] == {"Q8_0": 14, "F16": 2, "F32": 5}
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
        read = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
        fields = gguf.GGUFReader(out / "model.gguf").fields
        assert [fields[f"tokenizer.ggml.{key}"].contents() for key in ("model", "pre")] == TOKENIZER_KIND[arch]
        for text in (TEXT, DIGITS):  # the pre-tokenizer decides how digits group before the merges
            assert read(text)["input_ids"] == tok(text)["input_ids"], text
        assert read.chat_template == CHAT_TEMPLATE
        assert read.apply_chat_template(chat, add_generation_prompt=True) == tok.apply_chat_template(
            chat, add_generation_prompt=True)
        got = logits_of(model, ids)
        rounded = rounded_like(merged, gguf_type)
        strict = (got - logits_of(rounded, ids)).abs().max().item()
        assert strict < 1e-5, (gguf_type, strict)
        eps = max(((r - p).norm() / p.norm()).item() for p, r in
                  zip(matrices, (p for p in rounded.parameters() if p.ndim == 2)))
        bound = 2 * len(matrices) ** 0.5 * eps * want.abs().max().item()
        diff = (got - want).abs().max().item()
        assert diff == 0 if gguf_type == "f32" else diff <= bound, (gguf_type, diff, bound)


def policy_stub(folder: Path, base: str) -> Path:
    """An adapter folder whose checks pass until the base loads (its weights are never read)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    (folder / "base_model.json").write_text(json.dumps({"model_name_or_path": base, "quantization": "none"}))
    return folder


def test_what_gguf_export_cannot_write_is_one_line_before_the_base_loads_and_nothing_is_written(
        tmp_path, capsys, monkeypatch):
    """An architecture outside llama, mistral and qwen2 (gpt_neox, phi3), a preset whose borrowed tokenizer has
    more tokens than its embedding rows, and the flags of the other format: each one line, exit 2, before the
    base loads, and --out never appears."""
    from transformers import AutoConfig

    import trainer.export
    from foundation.cli import run

    monkeypatch.setattr(trainer.export, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    cases = []
    for model_type in ("gpt_neox", "phi3"):
        folder = small_tokenizer(tmp_path / model_type, "byte_level")
        AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                             intermediate_size=128, vocab_size=400).save_pretrained(folder)
        adapter = policy_stub(tmp_path / f"adapter-{model_type}", str(folder))
        cases.append((["--adapter", str(adapter), "--format", "gguf"],
                      f"error: --format gguf: the base is a {model_type} model; GGUF export writes llama, mistral, "
                      "qwen2 (export a Hugging Face folder, --format hf, and convert it with llama.cpp's "
                      "convert_hf_to_gguf.py)"))
    borrowed = policy_stub(tmp_path / "adapter-llama-2-7b", "llama-2-7b")
    cases += [
        (["--adapter", str(borrowed), "--format", "gguf"],
         "error: --format gguf: the tokenizer has 49,152 tokens, the model 32,000 embedding rows (a preset with a "
         "borrowed tokenizer?): its text cannot be written to GGUF"),
        (["--adapter", str(borrowed), "--gguf_type", "q8_0"],
         "error: --gguf_type q8_0: is for --format gguf; a Hugging Face folder takes --dtype"),
        (["--adapter", str(borrowed), "--format", "gguf", "--dtype", "float16"],
         "error: --dtype float16: is for --format hf; a GGUF file takes --gguf_type (f32, f16, bf16, q8_0)"),
        (["--adapter", str(borrowed), "--format", "gguf", "--gguf_type", "q4_k"],
         "error: --gguf_type 'q4_k': must be one of f32, f16, bf16, q8_0"),
    ]
    out = tmp_path / "out"
    for argv, line in cases:
        with pytest.raises(SystemExit) as exit_info:
            run(trainer.export.main, argv + ["--out", str(out)])
        err = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error: ")]
        assert exit_info.value.code == 2 and err == [line], (argv, err)
        assert not out.exists()


def test_interleaved_query_rows_rotate_in_pairs_as_transformers_rotates_halves():
    """llama.cpp's llama rotates each head's dimensions (2i, 2i+1) together, transformers (i, i + d/2): the query
    computed with the reordered rows and rotated in pairs is transformers' rotated query with its dimensions
    reordered the same way, so every attention score (a dot product over a head) is unchanged."""
    from trainer.gguf_export import interleave_rotary_rows

    heads, dim, hidden, pos = 3, 8, 12, 5
    torch.manual_seed(0)
    weight, x = torch.randn(heads * dim, hidden), torch.randn(hidden)
    angles = pos * 10000.0 ** (-torch.arange(0, dim, 2).float() / dim)  # (dim/2,) one angle per rotated pair
    cos, sin = angles.cos(), angles.sin()

    q = (weight @ x).view(heads, dim)
    first, second = q[:, : dim // 2], q[:, dim // 2:]
    halves = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    pairs = (interleave_rotary_rows(weight, heads) @ x).view(heads, dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    interleaved = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).view(heads, dim)

    assert torch.allclose(interleaved, interleave_rotary_rows(halves.reshape(-1), heads).view(heads, dim), atol=1e-6)
    other = torch.randn(heads, dim)
    assert torch.allclose((interleaved * interleave_rotary_rows(other.reshape(-1), heads).view(heads, dim)).sum(-1),
                          (halves * other).sum(-1), atol=1e-5)


def test_llama3_rotary_scaling_is_written_as_llama_cpps_per_frequency_divisors():
    """Llama 3.1's rotary scaling: frequencies with a wavelength under original_context / high_freq_factor are
    kept (divisor 1), those over original_context / low_freq_factor divided by factor, the ones between
    smoothly in between."""
    import math

    from transformers import AutoConfig

    from trainer.gguf_export import llama3_rope_factors

    config = AutoConfig.for_model("llama", hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                  rope_theta=500000.0)
    divisors = llama3_rope_factors(config)
    wavelengths = 2 * math.pi * 500000.0 ** (torch.arange(0, 128, 2).double() / 128)
    assert divisors.shape == (64,)
    assert torch.all(divisors[wavelengths < 8192 / 4] == 1.0) and (wavelengths < 8192 / 4).sum() > 10
    assert torch.allclose(divisors[wavelengths > 8192], torch.tensor(8.0)) and (wavelengths > 8192).sum() > 10
    between = divisors[(wavelengths >= 8192 / 4) & (wavelengths <= 8192)]
    assert len(between) > 0 and torch.all((between > 1.0) & (between < 8.0))


def test_a_disk_that_fills_while_writing_the_gguf_file_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    import gguf

    from foundation.cli import run
    from trainer.export import main

    adapter, _ = saved_policy(tmp_path / "adapter", tiny_base(tmp_path, "llama"))

    def full(writer, *args, **kwargs):
        writer.fout[0].write(b"\0" * 64)  # a part of the tensors written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as exit_info:
        run(main, ["--adapter", str(adapter), "--out", str(out), "--format", "gguf"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: --out {out}: could not be written (No space left on device; ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "tokenizer"]
