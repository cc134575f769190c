"""Checkpoints a run can trust: never code on load, damaged ones skipped, stale ones never resumed."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.engine.checkpoint import (
    MANIFEST_FILE, CheckpointError, complete_checkpoints, select_checkpoint, write_manifest,
)

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"


def run_sft(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "trainer" / "sft.py"), "--config", str(TINY_SFT),
                           "--output_dir", str(out), "--eval_every", "0", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny SFT run of 4 steps with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    proc = run_sft(out, "--max_steps", "4", "--save_every", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-0000002", "checkpoint-0000004"]
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


class Payload:
    """Unpickling this creates a folder: proof that loading ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def plant_payload(checkpoint: Path, marker: Path, fix_manifest: bool) -> None:
    with open(checkpoint / "rng-rank0.pt", "wb") as f:
        pickle.dump({"python": Payload(marker)}, f)
    if fix_manifest:  # the attacker rewrote the checksums too: only loading without pickles saves us
        write_manifest(checkpoint)


def test_a_planted_pickle_payload_is_refused_and_never_runs(run_copy, tmp_path):
    marker = tmp_path / "payload-ran"
    checkpoint = run_copy / "checkpoint-0000004"
    plant_payload(checkpoint, marker, fix_manifest=True)
    proc = run_sft(run_copy, "--max_steps", "6", "--save_every", "2", "--resume", str(checkpoint))
    assert not marker.exists(), "loading the checkpoint ran the planted code"
    assert proc.returncode != 0
    assert "rng-rank0.pt: refused" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_copy / "checkpoint-0000006").exists()


def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one_with_one_warning(run_copy, tmp_path):
    marker = tmp_path / "payload-ran"
    plant_payload(run_copy / "checkpoint-0000004", marker, fix_manifest=False)
    proc = run_sft(run_copy, "--max_steps", "6", "--save_every", "2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert not marker.exists()
    warnings = [line for line in proc.stdout.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and "checkpoint-0000004/rng-rank0.pt" in warnings[0], warnings
    assert "resumed from" in proc.stdout and "checkpoint-0000002 (step 2)" in proc.stdout
    # The damaged newer checkpoint went aside: pruning (which keeps the highest steps) cannot prefer it.
    aside = [p for p in run_copy.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint-0000004" / "rng-rank0.pt").is_file()
    assert [p.name for p in complete_checkpoints(run_copy)] == [f"checkpoint-000000{s}" for s in (2, 4, 6)]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.json", "state.json", "rng-rank0.pt", "config.json",
                                  "adapters/policy/adapter_model.safetensors", "adapters/policy/adapter_config.json"])
def test_each_truncated_file_is_caught_and_named(run_copy, name, caplog):
    _truncate(run_copy / "checkpoint-0000004" / name)
    with caplog.at_level(logging.WARNING, logger="trainer.engine.checkpoint"):
        chosen = select_checkpoint(run_copy, "auto")
    assert chosen.name == "checkpoint-0000002"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"checkpoint-0000004/{name}" in warnings[0], warnings
    with pytest.raises(CheckpointError, match=name.split("/")[-1]):
        select_checkpoint(run_copy, str(run_copy / "checkpoint-0000004"))


def test_a_truncated_file_is_caught_without_a_manifest_too(run_copy, caplog):
    for checkpoint in complete_checkpoints(run_copy):
        (checkpoint / MANIFEST_FILE).unlink()  # as an older version wrote them
    _truncate(run_copy / "checkpoint-0000004" / "optimizer.pt")
    assert select_checkpoint(run_copy, "auto").name == "checkpoint-0000002"


def test_no_usable_checkpoint_is_one_error_naming_the_folder(run_copy):
    for checkpoint in complete_checkpoints(run_copy):
        _truncate(checkpoint / "optimizer.pt")
    with pytest.raises(CheckpointError, match="none of its 2 checkpoints can be resumed"):
        select_checkpoint(run_copy, "auto")


def test_checkpoints_hold_tensors_and_plain_data_only(finished_run):
    checkpoint = finished_run / "checkpoint-0000004"
    for name in ("optimizer.pt", "rng-rank0.pt"):
        torch.load(checkpoint / name, weights_only=True)  # raises on anything that is not plain data
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    assert {"optimizer.pt", "rng-rank0.pt", "scheduler.json", "state.json", "config.json",
            "adapters/policy/adapter_model.safetensors"} <= set(manifest)


def test_resume_no_sets_the_earlier_run_aside_so_it_is_never_resumed(run_copy):
    proc = run_sft(run_copy, "--resume", "no", "--max_steps", "2", "--save_every", "2", "--learning_rate", "0.001")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert [p.name for p in complete_checkpoints(run_copy)] == ["checkpoint-0000002"]
    aside = [p for p in run_copy.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint-0000004").is_dir() and (aside[0] / "adapter").is_dir()
    # Continuing the new run resumes the new run's checkpoint, not the earlier run's newer one.
    proc = run_sft(run_copy, "--max_steps", "4", "--save_every", "2", "--learning_rate", "0.001")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "checkpoint-0000002 (step 2)" in proc.stdout


def test_the_checkpoints_own_settings_decide_not_the_folders_config(run_copy):
    # A stale folder: config.json says lr 0.001 (a later run that died before its first checkpoint),
    # while the newest checkpoint was saved by a run with lr 0.002.
    config = json.loads((run_copy / "config.json").read_text())
    config["train"]["learning_rate"] = 0.001
    (run_copy / "config.json").write_text(json.dumps(config))
    proc = run_sft(run_copy, "--max_steps", "6", "--learning_rate", "0.001")
    assert proc.returncode != 0
    assert "train.learning_rate: 0.002 -> 0.001" in proc.stderr and "checkpoint-0000004" in proc.stderr


def test_other_files_behind_dataset_auto_count_as_a_data_change(run_copy, shared_data, tmp_path):
    subset = tmp_path / "data"
    shutil.copytree(shared_data / "harmless-base", subset / "harmless-base")
    proc = run_sft(run_copy, "--max_steps", "6", env={"RLHF_DATA": str(subset)})
    assert proc.returncode != 0
    assert "resolved.dataset_fingerprint" in proc.stderr


def test_a_half_written_metrics_line_is_dropped_not_fatal(tmp_path):
    from trainer.engine.metrics import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/lo')
    assert read_metrics(tmp_path) == [{"step": 1, "train/loss": 2.0}]


def test_every_rank_runs_the_same_number_of_evaluation_batches():
    """Under ZeRO-3 / FSDP every forward gathers weights from all ranks: a rank with a row less must
    still run as many forwards (its extra one flagged not real)."""
    from types import SimpleNamespace

    from trainer.data.tokenization import SFTExample
    from trainer.engine.batches import eval_batches

    examples = [SFTExample([1] * (i + 2), [2], f"row{i}") for i in range(17)]

    def collate(rows):
        return {"input_ids": torch.tensor([[len(r.input_ids)] for r in rows])}

    seen = {}
    for rank in (0, 1):
        acc = SimpleNamespace(process_index=rank, num_processes=2, device=torch.device("cpu"), is_main_process=rank == 0)
        seen[rank] = list(eval_batches(examples, collate, 8, acc, progress=False))
    assert len(seen[0]) == len(seen[1]) == 2  # 9 and 8 rows in batches of 8
    assert [real for _, real in seen[0]] == [True, True] and [real for _, real in seen[1]] == [True, False]
    rows = [int(x) for r in (0, 1) for batch, real in seen[r] if real for x in batch["input_ids"].flatten()]
    assert sorted(rows) == sorted(e.length for e in examples)  # every example once, on one rank
