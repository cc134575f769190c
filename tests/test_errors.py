"""Every bad input a user can give ends the command with ONE line naming the thing and what to do:
exit code 2 for flags and config files, 1 for data, model, adapter and checkpoint files, and never a
model loaded before the settings and the data have been checked.

Each case runs the entry point in this process through `foundation.cli.run`, the wrapper every
`python -m ...` / `accelerate launch ...` goes through; `tests/test_config_errors.py` runs a few of the
same cases as real subprocesses.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from foundation.cli import run

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
TINY_PPO = ROOT / "tests" / "configs" / "tiny_ppo.yaml"
TINY_GRPO = ROOT / "tests" / "configs" / "tiny_grpo.yaml"
GOOD_ROW = {"chosen": "\n\nHuman: How do I bake bread?\n\nAssistant: Mix flour, water and yeast, then bake it.",
            "rejected": "\n\nHuman: How do I bake bread?\n\nAssistant: No."}


def rows_file(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def adapter_folder(path: Path, config: str | None = '{"r": 4, "lora_alpha": 8}', weights: bool = False) -> Path:
    path.mkdir(parents=True)
    if config is not None:
        (path / "adapter_config.json").write_text(config)
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return path


def sft(tmp, *extra):
    return ("trainer.sft", ["--config", str(TINY_SFT), "--output_dir", str(tmp / "run"), *extra])


def ppo(tmp, *extra):
    return ("trainer.ppo", ["--config", str(TINY_PPO), "--output_dir", str(tmp / "run"), *extra])


def grpo(tmp, *extra):
    return ("trainer.grpo", ["--config", str(TINY_GRPO), "--output_dir", str(tmp / "run"), *extra])


def evaluate(*args):
    return ("trainer.evaluate", list(args))


def cases(tmp: Path, shared: Path) -> dict[str, tuple]:
    """name -> ((module, argv), exit code, text the one line must hold). Files are made in `tmp`."""
    (tmp / "a-file").write_text("")
    all_bad = rows_file(tmp / "all_bad.jsonl", [{"chosen": "same", "rejected": "same"}] * 20)
    too_long = rows_file(tmp / "too_long.jsonl", [GOOD_ROW] * 30 + [
        {"chosen": GOOD_ROW["chosen"] + " very" * 200, "rejected": GOOD_ROW["rejected"]}])
    corrupt = tmp / "corrupt.jsonl.gz"
    corrupt.write_bytes(gzip.compress(b'{"chosen": "a"}\n' * 50)[:40] + b"\xff" * 64)
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("train:\n  max_steps: [1,\n")
    float_steps = tmp / "float.yaml"
    float_steps.write_text("train:\n  max_steps: 2.5\n")
    word_steps = tmp / "word.yaml"
    word_steps.write_text('train:\n  max_steps: "ten"\n')
    empty_config = tmp / "empty.yaml"
    empty_config.write_text("")
    wrong_section = tmp / "wrong.yaml"
    wrong_section.write_text("model:\n  learning_rate: 0.1\n")
    unknown_section = tmp / "unknown.yaml"
    unknown_section.write_text("optimizer:\n  lr: 0.1\n")
    duplicate_key = tmp / "duplicate_key.yaml"
    duplicate_key.write_text("train:\n  max_steps: 3\n  learning_rate: 0.1\n  max_steps: 5\n")
    duplicate_section = tmp / "duplicate_section.yaml"
    duplicate_section.write_text("train:\n  max_steps: 3\nmodel:\n  lora_r: 4\ntrain:\n  learning_rate: 0.1\n")
    no_weights = adapter_folder(tmp / "no-weights")
    bad_config = adapter_folder(tmp / "bad-config", config="{not json", weights=True)
    bad_memory = tmp / "bad-memory"
    bad_memory.mkdir()
    (bad_memory / "memory.json").write_text("{truncated")
    sft_like = adapter_folder(tmp / "sft-adapter", weights=True)  # a saved adapter without a head
    recipe = tmp / "recipe"  # a PPO recipe: no grpo.yaml for RLOO
    recipe.mkdir()
    for name in ("sft", "reward", "ppo"):
        shutil.copy(ROOT / "tests" / "configs" / "tiny_recipe" / f"{name}.yaml", recipe)
    return {
        # data
        "every row skipped": (sft(tmp, "--dataset", str(all_bad)), 1, "0 usable rows"),
        "corrupt gzip": (sft(tmp, "--dataset", str(corrupt)), 1, f"{corrupt}: unreadable_file"),
        "too_long under --on_bad_row error": (
            sft(tmp, "--dataset", str(too_long), "--on_bad_row", "error", "--eval_size", "0", "--sft_size", "100",
                "--reward_size", "0"), 1,
            f"{too_long}:31: too_long"),
        "missing data folder": (sft(tmp, "--dataset", str(tmp / "nowhere")), 1, "no such file or folder"),
        # flags and settings checked at parse time
        "gradient_accumulation_steps 0": (sft(tmp, "--gradient_accumulation_steps", "0"), 2,
                                          "--gradient_accumulation_steps 0: must be at least 1"),
        "max_steps -3": (sft(tmp, "--max_steps", "-3"), 2, "--max_steps -3: must be at least 1"),
        "max_length under min_prompt_tokens": (sft(tmp, "--max_length", "4", "--min_prompt_tokens", "8"), 2,
                                               "--max_length 4 must exceed --min_prompt_tokens 8"),
        "unknown flag": (sft(tmp, "--max_stepz", "3"), 2, "unrecognized arguments: --max_stepz 3"),
        "bool flag not a bool": (sft(tmp, "--packing", "maybe"), 2, "--packing"),
        "unknown choice": (sft(tmp, "--optimizer", "sgd"), 2, "--optimizer 'sgd': must be one of"),
        "bad preset override": (sft(tmp, "--preset_overrides", "num_layers=2"), 2,
                                "--preset_overrides: 'num_layers' is not a LlamaConfig field"),
        "ppo scripted_reward typo": (ppo(tmp, "--scripted_reward", "lenght:5"), 2,
                                     "--scripted_reward 'lenght:5'"),
        "ppo rollout_batch_size 0": (ppo(tmp, "--rollout_batch_size", "0"), 2,
                                     "--rollout_batch_size 0: must be at least 1"),
        "ppo without a scorer": (ppo(tmp, "--scripted_reward", "null"), 2, "PPO needs a scorer"),
        "ppo batch sizes": (ppo(tmp, "--mini_batch_size", "3"), 2, "must be a multiple of --mini_batch_size (3)"),
        "learning_rate inf": (sft(tmp, "--learning_rate", "inf"), 2, "--learning_rate inf: must be a finite number"),
        "weight_decay inf": (sft(tmp, "--weight_decay", "inf"), 2, "--weight_decay inf: must be a finite number"),
        "split_seed -1": (sft(tmp, "--split_seed", "-1"), 2, "--split_seed -1: must be in [0, 9223372036854775807]"),
        # runs that can never learn
        "grpo one generation per prompt": (grpo(tmp, "--num_generations", "1", "--mini_batch_size", "4"), 2,
                                           "--num_generations 1: GRPO compares each response with the others"),
        "grpo greedy sampling": (grpo(tmp, "--temperature", "0"), 2,
                                 "--temperature 0 (greedy) samples the 4 responses of a prompt alike"),
        "grpo top_k 1": (grpo(tmp, "--top_k", "1"), 2, "--top_k 1 samples the 4 responses of a prompt alike"),
        "ppo temperature inf": (ppo(tmp, "--temperature", "inf"), 2, "--temperature inf: must be a finite number"),
        # lengths beyond the model's positions (tiny-llama: 1024)
        "max_length beyond the positions": (sft(tmp, "--max_length", "2048"), 2,
                                            "--max_length 2048 exceeds the 1024 positions of tiny-llama"),
        "prompt + max_new_tokens beyond the positions": (
            ppo(tmp, "--max_new_tokens", "1010"), 2,
            "--max_prompt_length 24 + --max_new_tokens 1010 = 1034 tokens exceed the 1024 positions of tiny-llama"),
        # config files
        "YAML syntax error": (("trainer.sft", ["--config", str(bad_yaml)]), 2, f"{bad_yaml}: not valid YAML at line"),
        "float in an int field": (("trainer.sft", ["--config", str(float_steps)]), 2,
                                  f"{float_steps}: max_steps: 2.5 must be a whole number"),
        "word in an int field": (("trainer.sft", ["--config", str(word_steps)]), 2,
                                 f"{word_steps}: max_steps: 'ten' must be a whole number"),
        "empty config file": (("trainer.sft", ["--config", str(empty_config)]), 2, f"{empty_config}: sets nothing"),
        "key in the wrong section": (("trainer.sft", ["--config", str(wrong_section)]), 2,
                                     "unknown key 'learning_rate' in section 'model' (it belongs in section 'train')"),
        "unknown section": (("trainer.sft", ["--config", str(unknown_section)]), 2, "unknown section 'optimizer'"),
        "duplicate key": (("trainer.sft", ["--config", str(duplicate_key)]), 2,
                          f"{duplicate_key}: key 'max_steps' appears twice in section 'train' (lines 2 and 4)"),
        "duplicate section": (("trainer.sft", ["--config", str(duplicate_section)]), 2,
                              f"{duplicate_section}: section 'train' appears twice (lines 1 and 5)"),
        "config file missing": (("trainer.sft", ["--config", str(tmp / "none.yaml")]), 2, "config file not found"),
        # folders, models, adapters, checkpoints
        "output dir under a file": (sft(tmp, "--output_dir", str(tmp / "a-file" / "run")), 2, "cannot write there"),
        "unknown model name": (sft(tmp, "--model_name_or_path", "llama-3-9000"), 1, "unknown model 'llama-3-9000'"),
        "hub model id offline": (sft(tmp, "--model_name_or_path", "nobody/no-such-model"), 1,
                                 "tokenizer 'nobody/no-such-model' cannot be loaded"),
        "adapter without weights": (("trainer.reward", sft(tmp, "--sft_adapter", str(no_weights))[1]), 1,
                                    "has adapter_config.json but no weights"),
        "malformed adapter_config.json": (("trainer.reward", sft(tmp, "--sft_adapter", str(bad_config))[1]), 1,
                                          "adapter_config.json is not valid JSON"),
        "reward adapter without a head": (ppo(tmp, "--scripted_reward", "null", "--reward_adapter", str(sft_like)), 1,
                                          "needs its trained scalar head"),
        "resume from a non-checkpoint": (sft(tmp, "--resume", str(tmp)), 1, "not a complete checkpoint folder"),
        "offloaded embedding with a compiled decode": (grpo(tmp, "--offload_embeddings", "true", "--decode", "compiled"),
                                                       2, "--offload_embeddings needs --decode eager"),
        "memory budget too small": (sft(tmp, "--memory_budget_gib", "0.05"), 2, "exceeds memory_budget_gib=0.05"),
        # evaluate
        "evaluate: unknown task": (evaluate("perplexity", "--adapter", str(sft_like)), 2, "not 'perplexity'"),
        "evaluate: --split all without --data": (evaluate("sft", "--adapter", str(sft_like)), 2,
                                                 "--data is needed with --split all"),
        "evaluate: --split without a run": (evaluate("sft", "--adapter", str(sft_like), "--split", "eval"), 2,
                                            "does not exist: use --split all --data PATH"),
        "evaluate: no usable row": (evaluate("sft", "--adapter", str(sft_like), "--data", str(all_bad)), 1,
                                    "no usable rows in"),
        "evaluate: reward adapter without a head": (
            evaluate("reward", "--adapter", str(sft_like), "--data", str(shared / "harmless-base"), "--limit", "4"), 1,
            "needs its trained scalar head"),
        "evaluate: bad --limit": (evaluate("sft", "--adapter", str(sft_like), "--limit", "-1"), 2,
                                  "--limit -1: must be at least 0"),
        # the other tools
        "report: malformed memory.json": (("profiling.report", [str(bad_memory)]), 1, "memory.json: not JSON"),
        "report: no memory.json": (("profiling.report", [str(tmp)]), 2, "no memory report"),
        "estimate: max_length -5": (("profiling.estimate", ["--model", "llama-2-7b", "--stage", "sft",
                                                            "--max_length", "-5"]), 2, "--max_length -5: must be at least 2"),
        "estimate: unknown stage": (("profiling.estimate", ["--stage", "kto"]), 2, "--stage 'kto': must be one of"),
        "estimate: max_length past any model": (
            ("profiling.estimate", ["--model", "llama-2-7b", "--stage", "sft", "--max_length", "999999999999"]), 2,
            "--max_length 999999999999: must be at most 1,048,576 tokens"),
        "pipeline: --overrides output_dir": (("trainer.pipeline", ["--run_dir", str(tmp / "p"), "--overrides",
                                                                   f"output_dir={tmp / 'elsewhere'},max_steps=2"]), 2,
                                             "--overrides output_dir: the pipeline sets it"),
        "pipeline: unknown recipe": (("trainer.pipeline", ["--recipe", str(tmp / "nothing"), "--run_dir",
                                                           str(tmp / "p")]), 2, "no sft.yaml, reward.yaml, ppo.yaml"),
        "pipeline: malformed --overrides": (("trainer.pipeline", ["--overrides", "max_steps"]), 2,
                                            "--overrides: 'max_steps' is not key=value"),
        "report_to: unknown tracker": (sft(tmp, "--report_to", "tensorboard,neptune"), 2,
                                       "--report_to 'tensorboard,neptune': must be 'all', 'none', or trackers"),
        "report_to: tracker not installed": (sft(tmp, "--report_to", "clearml"), 2,
                                             "--report_to clearml: clearml is not installed (pip install clearml)"),
        "pipeline: unknown --algorithm": (("trainer.pipeline", ["--algorithm", "ppo,kto"]), 2,
                                          "--algorithm 'ppo,kto': must be one or more of ppo, grpo, rloo"),
        "pipeline: recipe without grpo.yaml": (("trainer.pipeline", ["--recipe", str(recipe), "--algorithm", "rloo",
                                                                     "--run_dir", str(tmp / "p")]), 2, "no grpo.yaml in"),
    }


def _names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return list(cases(Path(tmp), Path(tmp)))


CASE_NAMES = _names()


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading a base model at all fails the test: every error must come before it."""
    import trainer.model.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was caught")

    monkeypatch.setattr(loading, "load_base_model", refuse)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_ends_in_one_line_with_the_right_exit_code(name, tmp_path, shared_data, capsys, no_model_loading,
                                                             fresh_accelerate_state, monkeypatch):
    import importlib

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (module, argv), code, text = cases(tmp_path, shared_data)[name]
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        run(main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == code, err[-2000:]
    assert len(lines) == 1 and text in lines[0], err[-2000:]
    assert "Traceback" not in err
