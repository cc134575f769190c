"""The flag benchmark runs the real stage per variant and tabulates what the runs wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_flag_ladder_on_cpu_writes_a_table_with_one_row_per_rung(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "profiling.bench", "--stage", "sft", "--model_name_or_path",
                           "tiny-llama", "--config", str(ROOT / "tests" / "configs" / "tiny_sft.yaml"), "--steps", "2",
                           "--out_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    names = [r["name"] for r in data["rows"]]
    assert names[0].startswith("baseline") and names[-1].startswith("alternative: DeepSpeed")
    status = {r["name"]: r["status"] for r in data["rows"]}
    assert status["+ flash_attention_2"] == "skipped" and status[names[-1]] == "skipped"  # need CUDA
    ran = [r for r in data["rows"] if r["status"] == "ok"]
    assert len(ran) == 5, status
    for row in ran:
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_rss_bytes"] > 0
        assert row["peak_allocated_bytes"] is None  # no CUDA here: nothing invented
    assert ran[-1]["overrides"] == {"quantization": "nf4", "gradient_checkpointing": "true",
                                    "attn_implementation": "sdpa", "optimizer": "paged_adamw_8bit", "dtype": "float32"}
    assert data["git_revision"] and data["device"] == "cpu"
    assert "| + 4-bit NF4 base | ok |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0
