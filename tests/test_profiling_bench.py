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
                           # r=64: LoRA matrices of 4096+ elements, the size from which bitsandbytes keeps 8-bit states
                           "--extra", "lora_r=64,lora_alpha=128",
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
    # Each rung really ran with its flag: read what its own run wrote, not the ladder's settings.
    runs = {r["name"]: out / "runs" / f"{i:02d}" for i, r in enumerate(data["rows"]) if r["status"] == "ok"}

    def phase(name: str) -> dict:
        memory = json.loads((runs[name] / "memory.json").read_text())
        return next(p for p in memory["phases"] if p["phase"] == "forward_backward")

    baseline, sdpa = phase(names[0]), phase("+ SDPA attention")
    ckpt, nf4, adam8 = phase("+ gradient checkpointing"), phase("+ 4-bit NF4 base"), phase("+ paged 8-bit AdamW")
    # eager attention saves its (B, heads, T, T) probabilities for backward; SDPA does not keep them
    assert sdpa["saved_for_backward"] < baseline["saved_for_backward"]
    # checkpointing keeps each layer's input only (on the tiny model the LM head's logits, which it
    # does not touch, are most of what is saved: measured 82.3 -> 71.6 MB)
    assert ckpt["saved_for_backward"] < 0.9 * sdpa["saved_for_backward"]
    # the NF4 base holds packed 4-bit weights and their quantization constants; full precision has neither
    assert "base_quant_constants" not in ckpt["components"] and nf4["components"]["base_quant_constants"] > 0
    assert nf4["components"]["base_weights"] < 0.2 * ckpt["components"]["base_weights"]
    # 8-bit AdamW states: 2 bytes per parameter plus block statistics, against fp32 AdamW's 8
    assert adam8["components"]["optimizer_states"] < 0.35 * nf4["components"]["optimizer_states"]
    assert data["git_revision"] and data["device"] == "cpu"
    assert "| + 4-bit NF4 base | ok |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0
