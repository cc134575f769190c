"""Bad configurations fail at start with a message that names what to fix."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from conftest import in_process_command

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"


def start(script: str, *args: str) -> subprocess.CompletedProcess:
    """`trainer/SCRIPT.py --config tiny_sft.yaml ARGS` in this process (its exit code, stdout and stderr): what is
    tested is the message the entry point ends with, not the process around it."""
    return in_process_command(f"trainer.{script}", ["--config", str(TINY_SFT), *args])


def test_missing_adapter_folder_is_named(tmp_path):
    proc = start("reward", "--output_dir", str(tmp_path / "r"), "--sft_adapter", str(tmp_path / "runs" / "sft"))
    assert proc.returncode != 0
    assert f"--sft_adapter: {tmp_path / 'runs' / 'sft'} is not a saved adapter" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "checkpoint-0000002").exists()


def test_ppo_without_its_earlier_stages_says_which_output_is_absent(tmp_path):
    proc = start("ppo", "--output_dir", str(tmp_path / "p"), "--reward_adapter", str(tmp_path / "reward" / "adapter"))
    assert proc.returncode == 1 and "--reward_adapter" in proc.stderr and "is not a saved adapter" in proc.stderr
    proc = start("ppo", "--output_dir", str(tmp_path / "p"))
    assert proc.returncode != 0 and "PPO needs a scorer" in proc.stderr


def test_unknown_model_name_is_named_with_the_alternatives(tmp_path):
    proc = start("sft", "--output_dir", str(tmp_path / "s"), "--model_name_or_path", "llama-3-9000")
    assert proc.returncode != 0
    assert "unknown model 'llama-3-9000'" in proc.stderr and "smollm2-135m" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_budget_too_small_stops_before_loading_with_what_to_change(tmp_path):
    proc = start("sft", "--output_dir", str(tmp_path / "s"), "--memory_budget_gib", "0.05")
    assert proc.returncode != 0
    assert "exceeds memory_budget_gib=0.05" in proc.stderr
    assert "micro_batch_size 4 -> 2" in proc.stderr  # the estimator's first suggestion
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1  # one line
    assert "adapters policy" not in proc.stdout  # stopped before the model was built


def test_unknown_config_key_names_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_stepz: 3\n")
    proc = in_process_command("trainer.sft", ["--config", str(bad)])
    assert proc.returncode == 2 and f"{bad}: unknown key 'max_stepz' in section 'train'" in proc.stderr


def test_pipeline_with_an_unknown_recipe_fails_at_start(tmp_path):
    proc = in_process_command("trainer.pipeline", ["--recipe", str(tmp_path / "nothing"), "--run_dir",
                                                   str(tmp_path / "run")])
    assert proc.returncode != 0 and "no sft.yaml, reward.yaml, ppo.yaml" in proc.stderr


def test_override_values_may_be_comma_lists():
    """`--overrides` (pipeline), `--preset_overrides`: a part that does not start with key= continues the value
    before it, so list-valued settings (reward functions, their weights) pass through; a bare first part is
    still refused in one line."""
    import pytest

    from foundation.cli import UsageError, parse_assignments

    given = "reward_fn=a.py:right,b.py:formatted,reward_weights=1.0,0.25,max_steps=30"
    assert parse_assignments(given, "overrides") == {
        "reward_fn": "a.py:right,b.py:formatted", "reward_weights": "1.0,0.25", "max_steps": "30"}
    assert parse_assignments("num_hidden_layers=3, hidden_size=32", "x") == {"num_hidden_layers": "3",
                                                                            "hidden_size": "32"}
    with pytest.raises(UsageError, match="'max_steps' is not key=value"):
        parse_assignments("max_steps,reward_weights=1", "overrides")


NOT_FINITE = [  # (settings class, field, value, what the one line says): each passed or ended in a traceback before
    ("trainer.grpo:GRPOArguments", "beta", math.inf, "must be a finite number"),
    ("trainer.grpo:GRPOArguments", "missing_eos_penalty", math.nan, "must be a finite number"),
    ("trainer.grpo:GRPOArguments", "missing_eos_penalty", -math.inf, "must be a finite number"),
    ("trainer.grpo:GRPOArguments", "temperature", 1e-30, "must be 0 (greedy) or in [0.01, 100]"),
    ("trainer.ppo:PPOArguments", "init_kl_coef", math.inf, "must be a finite number"),
    ("trainer.ppo:PPOArguments", "vf_coef", math.inf, "must be a finite number"),
    ("trainer.ppo:PPOArguments", "entropy_coef", math.inf, "must be a finite number"),
    ("trainer.ppo:PPOArguments", "reward_timeout_s", 10 ** 400, "must be a finite number"),
    ("trainer.dpo:DPOArguments", "beta", math.inf, "must be a finite number"),
    ("trainer.dpo:DPOArguments", "beta", 1e30, "must be in [0.0001, 100]"),
    ("trainer.config:TrainArguments", "memory_budget_gib", math.inf, "must be a finite number"),
    ("trainer.config:ModelArguments", "model_seed", 10 ** 23, "must be in [0, 9223372036854775807]"),
]


@pytest.mark.parametrize("where, name, value, problem", NOT_FINITE, ids=[f"{c.split(':')[1]}.{n}={v}"
                                                                          for c, n, v, _ in NOT_FINITE])
def test_a_float_setting_must_be_finite_and_in_its_range(where, name, value, problem):
    import importlib

    from foundation.cli import UsageError

    module, _, cls = where.partition(":")
    with pytest.raises(UsageError) as raised:
        getattr(importlib.import_module(module), cls)(**{name: value})
    shown = repr(value)
    assert str(raised.value) == f"--{name} {shown if len(shown) <= 200 else shown[:200] + '...'}: {problem}"


def test_a_preset_override_that_is_not_a_positive_size_is_one_line():
    from foundation.cli import UsageError
    from profiling.shapes import preset_config

    for override in ("num_hidden_layers=-1", "hidden_size=0", "rms_norm_eps=inf"):
        with pytest.raises(UsageError, match=rf"--preset_overrides: {override} must be a finite number greater than 0"):
            preset_config("tiny-llama", 512, override)


def test_an_alias_bomb_a_deep_nest_and_a_huge_value_are_one_short_line(tmp_path):
    """A 9^7-value alias bomb is refused before it is built; 20,000 nested lists are refused, not a
    RecursionError; an error echoing a huge value is cut to a readable line."""
    from foundation.cli import FieldError, UsageError
    from foundation.config_files import read_yaml

    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\nmodel:\n  lora_r: *a6\n")
    assert len(bomb.read_bytes()) < 500
    with pytest.raises(UsageError, match=r"bomb.yaml: its aliases expand to more than 100,000 values"):
        read_yaml(bomb)
    deep = tmp_path / "deep.yaml"
    deep.write_text("model:\n  lora_r: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(UsageError, match=r"deep.yaml: nested too deep to read$"):
        read_yaml(deep)
    merged = tmp_path / "merged.yaml"  # anchors and merges of a real config stay readable
    merged.write_text("model: &m\n  lora_r: 8\ndata:\n  <<: *m\n")
    assert read_yaml(merged)["data"] == {"lora_r": 8}
    assert len(str(FieldError("lora_r", ["x"] * 10**6, "must be a whole number"))) < 300
    for flag in ("--lora_r", "--dataset"):  # argparse echoes the value; a path no filesystem takes
        proc = start("sft", "--output_dir", str(tmp_path / "s"), flag, "x" * 100_000)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-500:]
        assert max(len(line) for line in proc.stderr.splitlines()) < 2100


def test_a_pipeline_override_goes_only_to_the_stages_that_have_the_setting(tmp_path, monkeypatch):
    """`--overrides reward_fn=...` reaches the online stage alone (SFT refused it as an unknown argument); a
    setting no stage of the run has is refused before any stage runs."""
    import trainer.compare
    import trainer.pipeline
    import trainer.run_report
    from foundation.cli import UsageError

    ran = {}
    monkeypatch.setattr(trainer.pipeline, "run_stage", lambda name, argv, out, module=None: ran.setdefault(name, argv))
    monkeypatch.setattr(trainer.compare, "compare_policies", lambda *a: {})
    monkeypatch.setattr(trainer.run_report, "write_run_report", lambda *a: tmp_path / "report.md")
    given = "reward_fn=keyword:thanks,length:24,reward_weights=1.0,0.5,max_steps=2"
    trainer.pipeline.main(["--run_dir", str(tmp_path / "run"), "--algorithm", "grpo", "--overrides", given])
    assert list(ran) == ["sft", "reward", "grpo"]
    for name, argv in ran.items():
        assert argv[argv.index("--max_steps") + 1] == "2", name
        assert ("--reward_fn" in argv) == (name == "grpo") and ("--reward_weights" in argv) == (name == "grpo")
    grpo = ran["grpo"]
    assert grpo[grpo.index("--reward_fn") + 1] == "keyword:thanks,length:24"
    ran.clear()
    with pytest.raises(UsageError, match=r"--overrides beta_max: no stage of this pipeline \(sft, reward, ppo\) has"):
        trainer.pipeline.main(["--run_dir", str(tmp_path / "run2"), "--overrides", "beta_max=1,max_steps=2"])
    assert not ran


def test_help_lists_each_stage_s_flags_by_section_in_order():
    """--help reads as TRL's configs do: model, data, training, memory, rollout, method; each flag in one."""
    from foundation.cli import HELP_SECTIONS, parser_for
    from foundation.settings import DataArguments, ModelArguments, PPOArguments, TrainArguments
    from trainer.dpo import DPOArguments

    def sections(stage_cls) -> dict[str, list[str]]:
        text = parser_for([ModelArguments, DataArguments, TrainArguments, stage_cls]).format_help()
        out, current = {}, None
        for line in text.splitlines():
            if line.rstrip(":") in HELP_SECTIONS and line.endswith(":"):
                current = out.setdefault(line[:-1], [])
            elif current is not None and line.startswith("  --"):
                current.append(line.split()[0])
        return out

    ppo = sections(PPOArguments)
    assert list(ppo) == list(HELP_SECTIONS)
    assert {"--gradient_checkpointing", "--micro_batch_size", "--rollout_micro_batch_size", "--optimizer",
            "--generation_weights", "--quantization"} <= set(ppo["memory"])
    assert {"--temperature", "--max_new_tokens", "--reward_fn"} <= set(ppo["rollout"])
    assert {"--ppo_epochs", "--cliprange", "--init_kl_coef"} <= set(ppo["method"])
    assert "--lora_r" in ppo["model"] and "--dataset" in ppo["data"] and "--learning_rate" in ppo["training"]
    flags = [flag for names in ppo.values() for flag in names]
    assert len(flags) == len(set(flags))  # each flag once
    assert list(sections(DPOArguments)) == ["model", "data", "training", "memory", "method"]  # no rollout


def test_a_config_value_is_read_as_its_flag_would_be_or_refused_naming_the_file_and_key(tmp_path):
    """A string in a number or true/false field reads as the flag's text would ('2e-4', which YAML leaves a
    string); one that does not read so names the config file and key, never a flag that was not given. A flag
    given for the key replaces the bad value, as it replaces any config value."""
    from foundation.cli import UsageError
    from foundation.settings import PPOArguments
    from trainer.config import parse_config
    from trainer.sft import SFTArguments

    config = tmp_path / "config.yaml"
    config.write_text('train:\n  max_steps: "ten"\n  learning_rate: 2e-4\n')
    with pytest.raises(UsageError) as raised:
        parse_config(SFTArguments, ["--config", str(config)])
    assert str(raised.value) == f"{config}: max_steps: 'ten' must be a whole number"
    for flag in (["--max_steps", "3"], ["--max-steps=3"]):
        assert parse_config(SFTArguments, ["--config", str(config), *flag])[2].max_steps == 3
    config.write_text('train:\n  max_steps: "12"\n  learning_rate: 2e-4\nstage:\n  packing: "yes"\n')
    _, _, train, stage = parse_config(SFTArguments, ["--config", str(config)])
    assert (train.max_steps, train.learning_rate, stage.packing) == (12, 2e-4, True)
    config.write_text("stage:\n  packing: maybe\n")
    with pytest.raises(UsageError, match=r"config.yaml: packing: 'maybe' must be true or false$"):
        parse_config(SFTArguments, ["--config", str(config)])
    config.write_text("stage:\n  missing_eos_penalty: none\n  max_new_tokens: 16\n")
    stage = parse_config(PPOArguments, ["--config", str(config)])[3]
    assert stage.missing_eos_penalty is None and stage.max_new_tokens == 16
    config.write_text('model:\n  gradient_checkpointing: "false"\n')  # a field true by default has a --no_ flag too
    assert parse_config(SFTArguments, ["--config", str(config)])[0].gradient_checkpointing is False
    config.write_text("model:\n  gradient_checkpointing: maybe\n")
    assert parse_config(SFTArguments, ["--config", str(config), "--no_gradient_checkpointing"])[0] \
        .gradient_checkpointing is False  # the flag given replaces the bad value


@pytest.mark.parametrize("text", ["", "# every line commented out\n# max_steps: 3\n", "model:\ntrain:\n"],
                         ids=["empty", "comments", "empty sections"])
def test_a_config_file_that_sets_nothing_is_refused(tmp_path, text):
    from foundation.cli import UsageError
    from trainer.config import parse_config
    from trainer.sft import SFTArguments

    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(UsageError, match=r"config.yaml: sets nothing \(empty, only comments or only empty sections\)"):
        parse_config(SFTArguments, ["--config", str(config)])


def test_fp16_mixed_precision_without_cuda_is_refused_not_ignored(monkeypatch):
    """Accelerate drops fp16 autocast on the CPU and trains in float32; the run says so instead."""
    import torch

    from foundation.cli import UsageError
    from trainer.engine.launch import resolve_mixed_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"^--mixed_precision fp16 needs a CUDA GPU: on the CPU Accelerate ignores it"):
        resolve_mixed_precision("fp16")
    assert [resolve_mixed_precision(p) for p in ("auto", "no", "bf16")] == ["no", "no", "bf16"]


@pytest.mark.parametrize("key", ["output_dir", "sft_adapter", "reward_adapter"])
def test_a_pipeline_override_cannot_move_a_stage_out_of_the_run_folder(tmp_path, key):
    """The pipeline places each stage's output in --run_dir/STAGE and hands on the adapters trained there: an
    override of either is refused before anything is written."""
    import trainer.pipeline
    from foundation.cli import UsageError

    with pytest.raises(UsageError, match=rf"^--overrides {key}: the pipeline sets it"):
        trainer.pipeline.main(["--run_dir", str(tmp_path / "run"), "--overrides",
                               f"max_steps=2,{key}={tmp_path / 'elsewhere'}"])
    assert list(tmp_path.iterdir()) == []


def test_the_error_line_is_what_the_elastic_launcher_reports_as_the_cause(tmp_path, monkeypatch, capsys):
    """Under torchrun / `accelerate launch --multi_gpu` each process has TORCHELASTIC_ERROR_FILE: the line goes
    there too, so the launcher's failure summary names the cause instead of "To enable traceback see ..."."""
    import json

    from foundation.cli import UsageError, run

    def main(argv):
        raise UsageError("--max_steps 0: must be at least 1")

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as exit_info:
        run(main, [])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --max_steps 0: must be at least 1\n"
    assert json.loads(error_file.read_text())["message"]["message"] == "error: --max_steps 0: must be at least 1"
