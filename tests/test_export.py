"""`python -m trainer.export`: a policy adapter merged into a standalone Hugging Face model folder that
plain transformers loads, with no project code importable, and that computes the adapter model's
log-probs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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

    from trainer.model.loading import load_tokenizer, precision_record
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    tok = load_tokenizer(model_args.model_name_or_path)
    model = build_shared_model(model_args, [AdapterSpec("policy", trainable=True)], vocab_size=len(tok))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name and ".policy." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    out = model.save_adapter("policy", folder)
    trained_on = precision_record(model_args, torch.device("cpu"))
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
    from trainer.config import ModelArguments
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
    with torch.no_grad(), model.base_only():  # the adapter really moved the model: the export is not the base
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

    from trainer.config import ModelArguments
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
    for rounding in ("true", "false"):
        outs[rounding] = main(["--adapter", str(adapter), "--out", str(tmp_path / f"export-{rounding}"),
                               "--nf4_rounding", rounding, "--dtype", "float32"])
        got = torch.tensor(plain_load(outs[rounding], tmp_path)["logprobs"])
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
    from trainer.config import ModelArguments
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
    from trainer.config import ModelArguments

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
    from trainer.config import ModelArguments
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
    from trainer.config import ModelArguments
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
