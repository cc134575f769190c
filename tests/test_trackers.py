"""`report_to` takes Accelerate's trackers, several at once: a tiny SFT run logs to TensorBoard and to
Weights & Biases in its offline mode, both inside the run folder."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"


def test_a_run_logs_to_tensorboard_and_wandb_offline_at_once(tmp_path, monkeypatch, fresh_accelerate_state):
    import wandb  # noqa: F401  (a dev dependency: the test must run, not skip)

    from trainer.sft import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    main(["--config", str(TINY_SFT), "--output_dir", str(out), "--max_steps", "2", "--eval_every", "0",
          "--save_every", "0", "--report_to", "tensorboard,wandb"])
    assert list((out / "tensorboard").rglob("events.out.tfevents*"))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(out.rglob("*"))[:20]
    logged = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    assert b"train/loss" in logged and b"learning_rate" in logged  # the metrics and the run's config


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A machine where wandb has no key: no WANDB_* settings, no netrc, no wandb settings file."""
    import os

    for name in [n for n in os.environ if n.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def test_wandb_without_a_key_stops_the_run_at_start_in_one_line(tmp_path, no_wandb_login, capsys,
                                                                 fresh_accelerate_state):
    """wandb with no key, login or offline mode: the run stops in one line before it writes anything."""
    from foundation.cli import run
    from trainer.sft import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(main, ["--config", str(TINY_SFT), "--output_dir", str(out), "--report_to", "tensorboard,wandb"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: --report_to tensorboard,wandb: wandb finds no API key: set "
                                       "WANDB_API_KEY or run `wandb login`, or log to the run folder with "
                                       "WANDB_MODE=offline\n")
    assert not out.exists()


def test_wandb_logs_with_a_key_a_login_or_a_mode_that_needs_none(no_wandb_login, monkeypatch):
    """Each place wandb finds its key (or is told it needs none) lets the run start; a login for another server
    does not."""
    from foundation.cli import UsageError
    from trainer.engine.launch import trackers_for

    with pytest.raises(UsageError, match="wandb finds no API key"):
        trackers_for("all")  # every installed tracker, wandb among them
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "x" * 40)):
        monkeypatch.setenv(name, value)
        assert trackers_for("wandb") == ["wandb"], name
        monkeypatch.delenv(name)
    settings = no_wandb_login / ".config" / "wandb" / "settings"  # what `wandb offline` writes
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\nmode = offline\n")
    assert trackers_for("wandb") == ["wandb"]
    settings.unlink()
    (no_wandb_login / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert trackers_for("wandb") == ["wandb"]  # what `wandb login` writes
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    with pytest.raises(UsageError, match="wandb finds no API key"):
        trackers_for("wandb")
