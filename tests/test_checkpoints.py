"""Checkpoints a run can trust: never code on load, damaged ones skipped, stale ones never resumed."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import Payload, in_process_command

from foundation.settings import DATA_ENV
from trainer.engine.checkpoint import (
    MANIFEST_FILE, CheckpointError, complete_checkpoints, select_checkpoint, write_manifest,
)

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"


def run_sft(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`trainer/sft.py` on tiny_sft.yaml into `out`, in this process: what these tests read is the run's folder, its
    log and its one error line, not the process around it."""
    return in_process_command("trainer.sft", ["--config", str(TINY_SFT), "--output_dir", str(out), "--eval_every",
                                              "0", *extra])


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


def test_other_files_behind_dataset_auto_count_as_a_data_change(run_copy, shared_data, tmp_path, monkeypatch):
    subset = tmp_path / "data"
    shutil.copytree(shared_data / "harmless-base", subset / "harmless-base")
    monkeypatch.setenv(DATA_ENV, str(subset))
    proc = run_sft(run_copy, "--max_steps", "6")
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


def edit_state(checkpoint: Path, **changes) -> Path:
    """Change fields of the checkpoint's state.json and rewrite its manifest to match (an edit, not damage)."""
    state = json.loads((checkpoint / "state.json").read_text())
    (checkpoint / "state.json").write_text(json.dumps({**state, **changes}))
    write_manifest(checkpoint)
    return checkpoint / "state.json"


@pytest.mark.parametrize("changes, says", [
    (dict(step=-5), "step is -5, not an integer from 0 to 2147483647"),
    (dict(step=10**30), f"step is {10**30}, not an integer from 0 to 2147483647"),
    (dict(step="4"), 'step is "4", not an integer from 0 to 2147483647'),
    (dict(step=3), "step is 3, but the folder is checkpoint-0000004"),
    (dict(epoch=-1), "epoch is -1, not an integer from 0 to 2147483647"),
    (dict(batches_in_epoch=1.5), "batches_in_epoch is 1.5, not an integer from 0 to 2147483647"),
    (dict(bad_steps_total=9), "bad_steps_in_row 0, bad_steps_total 9 and step 4 are not in that order"),
    (dict(update_micro_batch=0), "update_micro_batch is 0, not an integer from 1 to 2147483647"),
    (dict(minibatch_rng=[0, 1, 2]), "minibatch_rng is not a random generator's state (5056 bytes)"),
    (dict(kl_controller={"kind": "adaptive", "value": -1.0}),
     'kl_controller is {"kind": "adaptive", "value": -1.0}, not a KL coefficient (a finite number >= 0) and its kind'),
], ids=["step-negative", "step-huge", "step-text", "step-not-the-folder-s", "epoch-negative", "batches-fraction",
        "bad-steps-out-of-order", "micro-batch-0", "rng-short", "kl-negative"])
def test_a_state_json_field_out_of_range_is_refused_naming_the_file_and_the_field(run_copy, changes, says, caplog):
    state = edit_state(run_copy / "checkpoint-0000004", **changes)
    with pytest.raises(CheckpointError) as error:
        select_checkpoint(run_copy, str(state.parent))
    assert str(error.value) == f"{state}: {says} (damaged or edited)"
    with caplog.at_level(logging.WARNING, logger="trainer.engine.checkpoint"):
        assert select_checkpoint(run_copy, "auto").name == "checkpoint-0000002"  # as a damaged one is skipped
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"skipping damaged checkpoint: {state}: {says} (damaged or edited); trying checkpoint-0000002"]


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def test_a_negative_step_in_state_json_stops_the_resume_in_one_line(run_copy):
    state = edit_state(run_copy / "checkpoint-0000004", step=-5)
    proc = run_sft(run_copy, "--max_steps", "6", "--save_every", "2", "--resume", str(state.parent))
    assert proc.returncode == 1
    assert error_lines(proc) == [f"error: {state}: step is -5, not an integer from 0 to 2147483647 (damaged or "
                                 "edited)"]
    assert [p.name for p in complete_checkpoints(run_copy)] == ["checkpoint-0000002", "checkpoint-0000004"]


def test_a_checkpoint_past_max_steps_is_refused_with_how_to_continue_it(run_copy):
    metrics = (run_copy / "metrics.jsonl").read_text()
    proc = run_sft(run_copy, "--max_steps", "3", "--save_every", "2")
    assert proc.returncode == 1
    state = run_copy / "checkpoint-0000004" / "state.json"
    assert error_lines(proc) == [f"error: {state}: step 4, past --max_steps 3: checkpoint-0000004 is a checkpoint of "
                                 "a longer run; continue it with --max_steps above 4, or start over with --resume no "
                                 "(or another --output_dir)"]
    assert (run_copy / "metrics.jsonl").read_text() == metrics  # nothing of the run was touched
    assert [p.name for p in complete_checkpoints(run_copy)] == ["checkpoint-0000002", "checkpoint-0000004"]


def test_resuming_onto_another_base_is_one_line_naming_the_checkpoint_and_what_differs(run_copy):
    """--resume_config_check false lets a changed base through; the weights themselves then tell."""
    proc = run_sft(run_copy, "--max_steps", "6", "--save_every", "2", "--preset_overrides", "num_hidden_layers=3",
                   "--resume_config_check", "false")
    assert proc.returncode == 1
    assert error_lines(proc) == [
        f"error: {run_copy / 'checkpoint-0000004'}: its weights do not fit this model (adapters/policy: no saved "
        "model.layers.2.mlp.down_proj.lora_A.weight (28 tensors saved, 42 here)): it was saved with another base or "
        "LoRA settings (model_name_or_path=tiny-llama, lora_r=4, lora_target_modules=all-linear); resume with "
        "those, or start over with --resume no"]
    assert not (run_copy / "checkpoint-0000006").exists()


def test_an_optimizer_state_of_other_parameters_is_named_before_anything_loads():
    from trainer.engine.checkpoint import optimizer_mismatch

    def adamw(*shapes):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(s)) for s in shapes])
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
        return opt

    saved = adamw((4, 8), (8, 4)).state_dict()
    assert optimizer_mismatch(adamw((4, 8), (8, 4)), saved) is None
    assert optimizer_mismatch(adamw((4, 8), (8, 4), (2,)), saved) == (
        "parameter groups of [2] tensors saved, [3] here: the optimizer state's shapes do not fit this model's "
        "trainable parameters")
    assert optimizer_mismatch(adamw((4, 16), (16, 4)), saved) == (
        "exp_avg of parameter 0 is [4, 8], the parameter [4, 16]: the optimizer state's shapes do not fit this "
        "model's trainable parameters")
    assert optimizer_mismatch(adamw((4, 8)), [1, 2]) == "not an optimizer state (no parameter groups)"
