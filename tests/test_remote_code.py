"""A model, tokenizer or adapter folder never runs its own Python unless the command line says
`--trust_remote_code true`: transformers' "Do you wish to run the custom code? [y/N]" is never asked, so a
`yes |` in front of the command runs nothing, and the folder is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
YES = "y\n" * 1000  # what `yes |` answers to any prompt


def code_folder(folder: Path, tokenizer, marker: Path, config_file: str) -> str:
    """A folder holding `tokenizer`'s files, whose `config_file` names a module that writes `marker` when imported
    (`conftest.plant_remote_code`)."""
    from conftest import plant_remote_code

    tokenizer.save_pretrained(folder)
    return plant_remote_code(folder, marker, config_file)


def adapter_on(folder: Path, **base) -> str:
    """A LoRA adapter folder whose base_model.json records `base` (model and tokenizer settings)."""
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(4, 64), key.format("B"): torch.zeros(64, 4)},
              str(folder / "adapter_model.safetensors"))
    (folder / "base_model.json").write_text(json.dumps({"model_name_or_path": "tiny-llama", **base}))
    return str(folder)


def eval_rows(tmp: Path) -> str:
    rows = [{"chosen": f"\n\nHuman: Question {i}?\n\nAssistant: Answer {i}.",
             "rejected": f"\n\nHuman: Question {i}?\n\nAssistant: No."} for i in range(8)]
    path = tmp / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# (the folder refused, the command after `python -m`, given tmp_path, the model folder and the tokenizer folder)
COMMANDS = {
    "export --adapter on a model folder with code": ("model", lambda t, m, k: [
        "trainer.export", "--adapter", adapter_on(t / "adapter", model_name_or_path=m), "--out", str(t / "out")]),
    "evaluate --adapter on a model folder with code": ("model", lambda t, m, k: [
        "trainer.evaluate", "sft", "--adapter", adapter_on(t / "adapter", model_name_or_path=m),
        "--data", eval_rows(t)]),
    "a stage's --model_name_or_path": ("model", lambda t, m, k: [
        "trainer.sft", "--config", str(TINY_SFT), "--output_dir", str(t / "run"), "--model_name_or_path", m]),
    "a stage's --tokenizer_name_or_path": ("tok", lambda t, m, k: [
        "trainer.sft", "--config", str(TINY_SFT), "--output_dir", str(t / "run"), "--tokenizer_name_or_path", k]),
    "export --adapter recording a tokenizer folder with code": ("tok", lambda t, m, k: [
        "trainer.export", "--adapter", adapter_on(t / "adapter", tokenizer_name_or_path=k), "--out", str(t / "out")]),
}


def folders(tmp_path: Path, tokenizer) -> tuple[Path, str, str]:
    marker = tmp_path / "RAN"
    return (marker, code_folder(tmp_path / "model", tokenizer, marker, "config.json"),
            code_folder(tmp_path / "tok", tokenizer, marker, "tokenizer_config.json"))


def assert_refused(tmp_path: Path, refused: str, marker: Path, code: int, stderr: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert not marker.exists(), f"the folder's code ran: {stderr[-2000:]}"
    assert code != 0 and "Traceback" not in stderr and "[y/N]" not in stderr, stderr[-2000:]
    assert len(errors) == 1 and str(tmp_path / refused) in errors[0] and "--trust_remote_code" in errors[0], errors
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(COMMANDS))
def test_a_folder_with_its_own_code_is_refused_in_one_line_and_runs_nothing_whatever_the_user_answers(
        case, tmp_path, smol_tokenizer, monkeypatch, capsys, fresh_accelerate_state):
    """Each entry point in-process, with every prompt answered "y" (transformers asked, then ran the code)."""
    import importlib

    from foundation.cli import run

    monkeypatch.setattr("builtins.input", lambda *_: "y")
    marker, model, tok = folders(tmp_path, smol_tokenizer)
    refused, command = COMMANDS[case]
    module, *argv = command(tmp_path, model, tok)
    with pytest.raises(SystemExit) as exited:
        run(importlib.import_module(module).main, argv)
    assert_refused(tmp_path, refused, marker, exited.value.code, capsys.readouterr().err)


def test_yes_piped_into_a_stage_on_a_folder_with_code_runs_nothing(tmp_path, smol_tokenizer):
    """The command as a user types it, `yes | python -m trainer.sft ... --model_name_or_path FOLDER`."""
    marker, model, tok = folders(tmp_path, smol_tokenizer)
    refused, command = COMMANDS["a stage's --model_name_or_path"]
    proc = subprocess.run([sys.executable, "-m", *command(tmp_path, model, tok)], cwd=ROOT, env=ENV, input=YES,
                          capture_output=True, text=True, timeout=300)
    assert "[y/N]" not in proc.stdout
    assert_refused(tmp_path, refused, marker, proc.returncode, proc.stderr)
