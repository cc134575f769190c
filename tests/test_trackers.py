"""`report_to` takes Accelerate's trackers, several at once: a tiny SFT run logs to TensorBoard and to
Weights & Biases in its offline mode, both inside the run folder."""

from __future__ import annotations

from pathlib import Path

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
