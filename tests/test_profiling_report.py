"""Memory reports: JSON with provenance, a Markdown table, a PNG chart, and the report CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundation.settings import ModelArguments
from profiling import components as C
from profiling.chart import DPI, FIGSIZE
from profiling.recorder import MemoryRecorder
from profiling.report import markdown_table
from trainer.model.shared_base import AdapterSpec, build_shared_model

ROOT = Path(__file__).resolve().parent.parent
PNG_SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def policy_and_value_model():
    args = ModelArguments(model_name_or_path="tiny-llama", quantization="none", gradient_checkpointing=False, lora_r=4)
    return build_shared_model(args, [AdapterSpec("policy", trainable=True), AdapterSpec("value", trainable=True,
                                                                                         head=True)], vocab_size=512)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model = policy_and_value_model()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    recorder = MemoryRecorder("ppo", model=model, optimizer=optimizer, budget_bytes=8 * C.GIB,
                              context_at_start=700 * 2**20)
    ids = torch.randint(0, 512, (2, 8))
    for phase in ("value", "update"):
        with recorder.phase(phase):
            model.scores(ids, torch.ones_like(ids), "value").sum().backward()
            optimizer.step()
    out = tmp_path_factory.mktemp("run")
    paths = recorder.write(out, config={"model": {"model_name_or_path": "tiny-llama", "lora_r": 4}})
    assert set(paths) == {"json", "md", "png"}
    return out


def test_json_report_has_provenance_config_and_phases(run_dir):
    data = json.loads((run_dir / "memory.json").read_text())
    for key in ("device", "device_name", "date", "command", "git_revision", "config", "budget_bytes", "phases",
                "needs_gpu", "gpu_reason", "versions"):
        assert key in data, key
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert data["git_revision"].startswith(head or "unknown")
    assert data["config"] == {"model": {"model_name_or_path": "tiny-llama", "lora_r": 4}}
    assert data["budget_bytes"] == 8 * 2**30
    assert data["cuda_context_at_start"] == 700 * 2**20  # the context the run's estimate had (vs_estimate reads it)
    assert [p["phase"] for p in data["phases"]] == ["value", "update"]
    update = data["phases"][1]
    # only the value adapter and head had gradients: AdamW's two fp32 moments of each weight, a step count per tensor
    model = policy_and_value_model()
    value = [p for p, adapter in model._lora_params if adapter == "value"] + list(model.heads["value"].parameters())
    assert update["components"][C.OPTIMIZER_STATES] == 8 * sum(p.numel() for p in value) + 4 * len(value)
    # on the CPU from the allocator's events (profiling/live.py); untracked resident bytes need CUDA's statistics
    assert update["components"][C.ACTIVATIONS] == update["live"]["peak"] - update["live"]["logits_at_peak"] > 0
    assert update["components"][C.ROLLOUT_BUFFERS] is None
    assert update["total"] == sum(v for v in update["components"].values() if v is not None)
    assert update["total"] > update["components"][C.BASE_WEIGHTS] + update["components"][C.OPTIMIZER_STATES]


def test_provenance_records_the_environment_settings_that_change_speed_and_memory(monkeypatch):
    from foundation.provenance import provenance, shown_command

    for name in list(os.environ):
        if name.startswith("MALLOC_") or name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "x")
    data = provenance(command="python -m benchmarks.stages_vs_trl --stage sft")
    assert data["environment"] == {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    assert data["command"] == "python -m benchmarks.stages_vs_trl --stage sft"  # the command itself is untouched
    assert shown_command(data) == "MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=2 python -m benchmarks.stages_vs_trl --stage sft"
    assert shown_command({"command": "c"}) == "c"  # reports written before the field existed


def test_the_git_revision_is_read_without_writing_into_the_repository(tmp_path):
    """`git status` refreshes a stale index (a tracked file touched since) by writing .git/index.lock and then
    the index: a run reading its revision must not. Under a file-size limit that write left a stale lock behind,
    and the user's next git command failed on it."""
    import subprocess

    from foundation.provenance import git_revision

    git = lambda *args: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                                       check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("commit", "-q", "-m", "a")
    index = tmp_path / ".git" / "index"
    before = index.read_bytes()
    os.utime(tmp_path / "a.txt", (1, 1))  # the index's stat of a.txt is stale: status would refresh it
    revision = git_revision(cwd=tmp_path)
    assert len(revision) == 40 and not revision.endswith("-dirty")
    assert index.read_bytes() == before and not (tmp_path / ".git" / "index.lock").exists()


def test_a_cpu_device_is_named_with_its_model_where_the_system_tells_it(monkeypatch, tmp_path):
    """CPU ratios move with the CPU (two VMs of the same size gave different PPO ratios), so results name it."""
    import foundation.provenance as device

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    assert device.cpu_model() == "AMD EPYC 9B14"
    assert device.device_name(torch.device("cpu")).startswith("cpu (AMD EPYC 9B14, ")
    monkeypatch.setattr(device, "cpu_model", lambda: None)  # no /proc/cpuinfo (macOS, Windows): the architecture
    assert device.device_name(torch.device("cpu")) == f"cpu ({device.platform.processor() or device.platform.machine()})"


def test_markdown_report_is_a_table_of_components_by_phase(run_dir):
    text = (run_dir / "memory.md").read_text()
    assert "| component (MiB) | ppo/value | ppo/update |" in text
    data = json.loads((run_dir / "memory.json").read_text())
    policy = data["phases"][1]["components"][C.adapter("policy")]
    assert f"| adapter/policy | {policy / 2**20:.3f} | {policy / 2**20:.3f} |" in text
    assert "| rollout_buffers | n/a (GPU) | n/a (GPU) |" in text
    assert "| activations | n/a (GPU)" not in text  # measured on the CPU too
    totals = [sum(v for v in p["components"].values() if v is not None) / 2**20 for p in data["phases"]]
    assert f"| **total** | **{totals[0]:.3f}** | **{totals[1]:.3f}** |" in text
    assert "Not measured here" in text and C.CUDA_CONTEXT in text


def test_png_chart_opens_with_the_expected_size(run_dir):
    from PIL import Image

    with Image.open(run_dir / "memory.png") as image:
        assert image.format == "PNG"
        assert image.size == PNG_SIZE
        assert len(set(image.convert("RGB").getdata())) > 10  # drawn on, not a blank canvas


def test_fits_row_says_no_over_budget():
    data = {"budget_bytes": 3 * C.GIB, "phases": [
        {"stage": "sft", "phase": "forward_backward", "components": {C.BASE_WEIGHTS: 2 * C.GIB, C.ACTIVATIONS: 2 * C.GIB}},
        {"stage": "sft", "phase": "optimizer_step", "components": {C.BASE_WEIGHTS: 2 * C.GIB}}]}
    table = markdown_table(data)
    assert "| **total** | **4.000** | **2.000** |" in table
    assert "| fits | **no** | yes |" in table


def test_report_cli_regenerates_markdown_and_png_from_the_json(run_dir):
    (run_dir / "memory.md").unlink()
    (run_dir / "memory.png").unlink()
    done = subprocess.run([sys.executable, "-m", "profiling.report", str(run_dir), "--budget-gib", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "budget 2.000 GiB" in (run_dir / "memory.md").read_text()
    from PIL import Image

    with Image.open(run_dir / "memory.png") as image:
        assert image.size == PNG_SIZE


def test_report_cli_rejects_a_folder_without_a_report(tmp_path):
    done = subprocess.run([sys.executable, "-m", "profiling.report", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no memory report" in done.stderr
