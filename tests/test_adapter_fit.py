"""A saved adapter is loaded only onto the base it was trained on, and only the command line turns on
trust_remote_code: every tool that rebuilds a base from an adapter's files (export, evaluate, compare)
and every stage that loads adapters refuses a mismatch in one line naming the file."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import Payload, adapter_state

from foundation.cli import InputError, run

TEXT = "\n\nHuman: How do I bake bread?\n\nAssistant: Mix flour, water and yeast, then bake it."
ROOT = Path(__file__).resolve().parent.parent
TINY_PPO = ROOT / "tests" / "configs" / "tiny_ppo.yaml"
# Other bases than tiny-llama's default: deeper, wider, and the same shape with other (random) weights.
OTHER_BASES = {
    "deeper": (dict(preset_overrides="num_hidden_layers=3"), "num_hidden_layers=3"),
    "wider": (dict(preset_overrides="hidden_size=32"), "hidden_size=32"),
    "other weights": (dict(model_seed=1), "other base weights"),
}


def tiny_args(**changes):
    from foundation.settings import ModelArguments

    return replace(ModelArguments(model_name_or_path="tiny-llama", quantization="none", lora_r=4, lora_alpha=8,
                                  lora_dropout=0.0, gradient_checkpointing=False), **changes)


def trained_policy(args):
    """A policy adapter on the base of `args` that really changes it (random LoRA B)."""
    from trainer.model.loading import load_tokenizer
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)],
                               vocab_size=len(load_tokenizer(args.model_name_or_path)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.peft.named_parameters():
            if "lora_B" in name and ".policy." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model


def stage_saved(run_dir: Path, args) -> Path:
    """`run_dir`/adapter as a stage's `save_final_adapter` writes it (with base_model.json)."""
    from accelerate import Accelerator

    from trainer.engine.launch import reset_accelerate
    from trainer.engine.setup import save_final_adapter
    from trainer.model.loading import model_plan

    ctx = SimpleNamespace(accelerator=Accelerator(cpu=True), model_args=args, output_dir=run_dir,
                          plan=model_plan(args, torch.device("cpu")))
    adapter = save_final_adapter(ctx, trained_policy(args), "policy")
    reset_accelerate()  # the command under test makes its own Accelerator
    return adapter


def old_style(adapter: Path) -> Path:
    """The adapter's base_model.json as versions before the base record wrote it (settings only)."""
    record = json.loads((adapter / "base_model.json").read_text())
    (adapter / "base_model.json").write_text(json.dumps({k: v for k, v in record.items()
                                                         if not k.startswith("base_")}))
    return adapter


def one_line_exit(main, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        run(main, argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return exit_info.value.code, lines[0]


@pytest.fixture
def loaded_bases(monkeypatch):
    """Stops every base-model load and records the settings it was asked with."""
    import trainer.export
    import trainer.model.loading

    asked = []

    class Loaded(Exception):
        pass

    def record(args, *rest, **kwargs):
        asked.append(args)
        raise Loaded

    monkeypatch.setattr(trainer.model.loading, "load_base_model", record)
    monkeypatch.setattr(trainer.export, "load_base_model", record)
    return SimpleNamespace(asked=asked, Loaded=Loaded)


def fake_adapter(folder: Path, record: dict, head: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "peft_type": "LORA"}')
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    if head:
        (folder / "head.safetensors").write_bytes(b"\0" * 8)
    (folder / "base_model.json").write_text(json.dumps(record))
    return folder


def tool_argv(tool: str, tmp: Path, adapter: Path) -> tuple:
    """(module main, argv) of `tool` on `adapter` (for compare: the run folder around it)."""
    import trainer.compare
    import trainer.evaluate
    import trainer.export

    if tool == "export":
        return trainer.export.main, ["--adapter", str(adapter), "--out", str(tmp / "out")]
    if tool == "evaluate":
        rows = tmp / "rows.jsonl"
        rows.write_text(json.dumps({"chosen": TEXT, "rejected": TEXT + " No."}) + "\n")
        return trainer.evaluate.main, ["sft", "--adapter", str(adapter), "--data", str(rows)]
    return trainer.compare.main, ["--run_dir", str(adapter.parent.parent)]


@pytest.mark.parametrize("tool", ["export", "evaluate", "compare"])
def test_a_saved_trust_remote_code_is_refused_unless_the_command_line_allows_it(tool, tmp_path, capsys, loaded_bases,
                                                                                 fresh_accelerate_state):
    asks = {"model_name_or_path": "tiny-llama", "trust_remote_code": True}
    adapter = fake_adapter(tmp_path / "run" / "sft" / "adapter", asks)
    fake_adapter(tmp_path / "run" / "ppo" / "adapter", asks)
    fake_adapter(tmp_path / "run" / "reward" / "adapter", asks, head=True)
    main, argv = tool_argv(tool, tmp_path, adapter)

    allow = ["--overrides", "trust_remote_code=true"] if tool == "compare" else ["--trust_remote_code", "true"]
    code, line = one_line_exit(main, argv, capsys)
    assert code == 1 and loaded_bases.asked == []
    assert line == (f"error: {adapter / 'base_model.json'}: asks for trust_remote_code (the base model's own Python "
                    f"code would run); only the command line can allow it: pass {' '.join(allow)} "
                    "if you trust that model")

    with pytest.raises(loaded_bases.Loaded):
        main(argv + allow)
    assert [a.trust_remote_code for a in loaded_bases.asked] == [True]


def test_a_saved_trust_remote_code_false_stays_off_without_the_flag(tmp_path, loaded_bases):
    from trainer.export import main

    adapter = fake_adapter(tmp_path / "adapter", {"model_name_or_path": "tiny-llama", "trust_remote_code": False})
    with pytest.raises(loaded_bases.Loaded):
        main(["--adapter", str(adapter), "--out", str(tmp_path / "out")])
    assert [a.trust_remote_code for a in loaded_bases.asked] == [False]


def test_a_stage_records_its_base_shape_and_fingerprint_beside_the_adapter(tmp_path, fresh_accelerate_state):
    from trainer.model.loading import load_base_model

    adapter = stage_saved(tmp_path, tiny_args())
    record = json.loads((adapter / "base_model.json").read_text())
    assert record.get("base_shape") == {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 172,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}
    assert len(record["base_fingerprint"]) == 16 and record["trust_remote_code"] is False
    from trainer.model.adapter_fit import base_fingerprint

    again = load_base_model(tiny_args(), vocab_size=49152, device=torch.device("cpu"))
    assert record["base_fingerprint"] == base_fingerprint(again)


@pytest.mark.parametrize("other", list(OTHER_BASES))
def test_an_adapter_of_another_base_is_refused_before_it_loads(other, tmp_path, fresh_accelerate_state):
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    changes, says = OTHER_BASES[other]
    adapter = stage_saved(tmp_path, tiny_args(**changes))
    with pytest.raises(InputError, match=f"adapter 'policy': {re.escape(str(adapter))} was trained on .*{says}"):
        build_shared_model(tiny_args(), [AdapterSpec("policy", init_from=str(adapter))], vocab_size=49152)


def test_the_same_base_in_another_dtype_passes_the_check(tmp_path, fresh_accelerate_state):
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    adapter = stage_saved(tmp_path, tiny_args())
    model = build_shared_model(tiny_args(dtype="bfloat16"), [AdapterSpec("policy", init_from=str(adapter))],
                               vocab_size=49152)
    assert model.adapter_names == ["policy"]


@pytest.mark.parametrize("other, says", [("deeper", "holds LoRA weights for model.layers.2.mlp.down_proj, a layer "
                                                    "this base (tiny-llama, 2 layers) does not have"),
                                         ("wider", "does not fit this base (tiny-llama): model.layers.0.mlp.down_proj "
                                                   "lora_B is [32, 4], this base's layer needs [64, 4]")])
def test_an_old_adapter_without_a_base_record_is_checked_by_its_weight_shapes(other, says, tmp_path,
                                                                              fresh_accelerate_state):
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    adapter = old_style(stage_saved(tmp_path, tiny_args(**OTHER_BASES[other][0])))
    with pytest.raises(InputError) as error:
        build_shared_model(tiny_args(), [AdapterSpec("policy", init_from=str(adapter))], vocab_size=49152)
    assert str(error.value) == (f"adapter 'policy': {adapter / 'adapter_model.safetensors'} {says}: the adapter was "
                                "trained on another base")


def test_an_old_adapter_of_the_same_base_still_loads(tmp_path, fresh_accelerate_state):
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    adapter = old_style(stage_saved(tmp_path, tiny_args()))
    model = build_shared_model(tiny_args(), [AdapterSpec("policy", init_from=str(adapter))], vocab_size=49152)
    assert model.adapter_names == ["policy"]


def test_ppo_refuses_an_sft_adapter_of_another_base_in_one_line(tmp_path, capsys, fresh_accelerate_state):
    from trainer.ppo import main

    adapter = stage_saved(tmp_path / "sft", tiny_args(**OTHER_BASES["deeper"][0]))
    code, line = one_line_exit(main, ["--config", str(TINY_PPO), "--output_dir", str(tmp_path / "ppo"),
                                      "--sft_adapter", str(adapter)], capsys)
    assert code == 1
    assert line.startswith(f"error: adapter 'policy': {adapter} was trained on tiny-llama with num_hidden_layers=3 "
                           f"({adapter / 'base_model.json'}), this base (tiny-llama) has num_hidden_layers=2")


def test_export_and_evaluate_refuse_an_adapter_whose_base_folder_now_holds_other_weights(tmp_path, capsys,
                                                                                         fresh_accelerate_state):
    """The base_model.json names a local model folder; the folder was overwritten with another model of the
    same shape after training: the fingerprint tells."""
    from trainer.evaluate import main as evaluate
    from trainer.export import main as export
    from trainer.model.loading import load_base_model

    from trainer.model.loading import load_tokenizer

    folder = tmp_path / "base"
    load_base_model(tiny_args(), vocab_size=49152, device=torch.device("cpu")).save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    adapter = stage_saved(tmp_path / "sft", tiny_args(model_name_or_path=str(folder)))
    load_base_model(tiny_args(model_seed=1), vocab_size=49152, device=torch.device("cpu")).save_pretrained(folder)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"chosen": TEXT, "rejected": TEXT + " No."}) + "\n")
    for main, argv in [(export, ["--adapter", str(adapter), "--out", str(tmp_path / "out")]),
                       (evaluate, ["sft", "--adapter", str(adapter), "--data", str(rows), "--progress_bar", "false"])]:
        code, line = one_line_exit(main, argv, capsys)
        what = "--adapter" if main is export else "adapter 'policy'"
        assert code == 1 and line.startswith(f"error: {what}: {adapter} was trained on other base weights than "
                                             f"this base's ({folder})"), line
    assert not (tmp_path / "out").exists()


def test_a_non_lora_adapter_is_refused_in_one_line(tmp_path, capsys, loaded_bases):
    from trainer.export import main

    adapter = fake_adapter(tmp_path / "loha", {"model_name_or_path": "tiny-llama"})
    (adapter / "adapter_config.json").write_text('{"r": 4, "alpha": 8, "peft_type": "LOHA"}')
    code, line = one_line_exit(main, ["--adapter", str(adapter), "--out", str(tmp_path / "out")], capsys)
    assert (code, line) == (1, f"error: --adapter: {adapter / 'adapter_config.json'} is a LOHA adapter; only LoRA "
                               "adapters can be used")
    assert loaded_bases.asked == []


def test_a_checkpoint_adapter_exports_onto_the_base_its_run_config_names(tmp_path, fresh_accelerate_state):
    """A checkpoint's adapters/NAME has no base_model.json: the checkpoint's config.json says the base."""
    from safetensors.torch import load_file

    from trainer.engine.checkpoint import CONFIG_FILE, checkpoint_dir
    from trainer.export import main

    args = tiny_args(preset_overrides="num_hidden_layers=3")
    checkpoint = checkpoint_dir(tmp_path / "run", 2)
    adapter = trained_policy(args).save_adapter("policy", checkpoint / "adapters" / "policy")
    (checkpoint / CONFIG_FILE).write_text(json.dumps({"model": asdict(args), "data": {}, "train": {}, "stage": {}}))
    assert not (adapter / "base_model.json").exists()

    out = main(["--adapter", str(adapter), "--out", str(tmp_path / "export")])
    assert json.loads((out / "export.json").read_text())["base"] == "tiny-llama"
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.layers.2.self_attn.q_proj.weight"].shape == (64, 64)


def test_an_adapter_config_whose_rank_is_not_its_weights_rank_is_one_line_naming_the_tensor(tmp_path, capsys,
                                                                                           fresh_accelerate_state):
    from trainer.export import main
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    adapter = stage_saved(tmp_path / "sft", tiny_args())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))  # the weights are r=4
    says = (f"{adapter} does not match its adapter_config.json: model.layers.0.mlp.down_proj lora_A is [4, 172] in "
            "adapter_model.safetensors, rank r=8 there needs [8, 172]; save the adapter again, or fix 'r' in "
            "adapter_config.json")
    with pytest.raises(InputError) as error:
        build_shared_model(tiny_args(), [AdapterSpec("policy", init_from=str(adapter))], vocab_size=49152)
    assert str(error.value) == f"adapter 'policy': {says}"
    code, line = one_line_exit(main, ["--adapter", str(adapter), "--out", str(tmp_path / "out")], capsys)
    assert (code, line) == (1, f"error: --adapter: {says}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tool", ["init_adapter", "export", "evaluate"])
def test_a_pickled_adapter_bin_is_refused_before_anything_unpickles_it(tool, tmp_path, capsys,
                                                                       fresh_accelerate_state):
    import pickle

    import trainer.sft

    adapter = stage_saved(tmp_path / "sft", tiny_args())
    (adapter / "adapter_model.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"weights": Payload(marker)}))
    if tool == "init_adapter":
        flag, main = "--init_adapter", trainer.sft.main
        argv = ["--config", str(ROOT / "tests" / "configs" / "tiny_sft.yaml"), "--output_dir", str(tmp_path / "run"),
                "--init_adapter", str(adapter)]
    else:
        flag, (main, argv) = "--adapter", tool_argv(tool, tmp_path, adapter)
    code, line = one_line_exit(main, argv, capsys)
    assert (code, line) == (1, f"error: {flag}: {adapter} holds adapter_model.bin, a pickle, which can run code when "
                               "loaded: only adapter_model.safetensors is read; convert it to safetensors where you "
                               "trust it")
    assert not marker.exists()


def test_a_saved_adapter_never_holds_the_base_embeddings(tmp_path, fresh_accelerate_state):
    """An SFT adapter whose adapter_config.json names another model folder (of another vocabulary) as its base:
    peft's save_embedding_layers='auto' would add this base's embed_tokens and lm_head to every adapter saved
    from it."""
    from safetensors import safe_open

    from trainer.model.shared_base import AdapterSpec, build_shared_model

    adapter = stage_saved(tmp_path / "sft", tiny_args())
    other = tmp_path / "other-base"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32000}))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(other)}))

    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True, init_from=str(adapter))],
                               vocab_size=49152)
    saved = model.save_adapter("policy", tmp_path / "ppo" / "adapter")
    with safe_open(str(saved / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert keys == set(f.keys()) and len(keys) == 28
    assert all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert (saved / "adapter_model.safetensors").stat().st_size < 50_000
    assert set(adapter_state(model, "policy")) == keys
