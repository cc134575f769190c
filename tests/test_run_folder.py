"""The run folder holds only what the run writes, each entry of its kind: a planted link, FIFO or folder where a
file goes is refused in one line before the run writes anything, and a write the filesystem refuses (a file
size limit) is one line too, with nothing half-written left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import limited_run

from foundation.cli import run

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"


def sft_argv(out: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY_SFT), "--output_dir", str(out), "--max_steps", "1", "--save_every", "0",
            "--eval_every", "0", *extra]


def plant(out: Path, outside: Path, kind: str) -> Path:
    """`out` with one planted entry (kind: 'ENTRY as WHAT'); `outside` holds what a link points at. Its path."""
    name, what = kind.split(" as ")
    entry = out / name
    if what == "link to a file":
        (outside / "precious.txt").write_text("keep me")
        entry.symlink_to(outside / "precious.txt")
    elif what == "link to a folder":
        entry.symlink_to(outside, target_is_directory=True)
    elif what == "fifo":
        os.mkfifo(entry)
    elif what == "folder":
        entry.mkdir()
    else:
        entry.write_text("a file")
    return entry


PLANTED = {  # entry -> what the line says it is
    "metrics.jsonl as link to a file": "a symbolic link",
    "metrics.jsonl as fifo": "not a regular file (a FIFO, socket or device)",
    "tensorboard as link to a folder": "a symbolic link",
    "config.json as folder": "a folder",
    "results.json as link to a file": "a symbolic link",
    "adapter as file": "a file, not a folder",
    "checkpoint-0000002 as link to a folder": "a symbolic link",
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_planted_entry_in_the_run_folder_is_refused_in_one_line_before_anything_is_written(
        kind, tmp_path, capsys, fresh_accelerate_state):
    """A link would send the run's metrics, events or config outside the folder (overwritten on resume), a FIFO
    would hang the first metrics line, a folder where config.json goes would fail after the data is loaded."""
    import trainer.sft as sft

    out, outside = tmp_path / "run", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    entry = plant(out, outside, kind)
    with pytest.raises(SystemExit) as stop:
        run(sft.main, sft_argv(out))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and "Traceback" not in err, err[-2000:]
    assert lines == [f"error: --output_dir {out}: its {entry.name} ({entry}) is {PLANTED[kind]}; remove it, or "
                     "pick another --output_dir"]
    assert sorted(p.name for p in out.iterdir()) == [entry.name]  # no run.lock, config.json or metrics left
    if kind.endswith("link to a file"):
        assert [p.name for p in outside.iterdir()] == ["precious.txt"]
        assert (outside / "precious.txt").read_text() == "keep me"
    else:
        assert list(outside.iterdir()) == []  # no events or checkpoint written through a link


def test_a_file_size_limit_at_start_up_stops_in_one_line_leaving_the_folder_empty(tmp_path, smol_tokenizer, forks):
    """`ulimit -f 1`: config.json (a few KB) cannot be written; one line naming it and the limit, exit 1, and no
    temporary config.json or run.lock left behind."""
    out = tmp_path / "run"
    proc = limited_run(forks, "trainer.sft", sft_argv(out), file_size=1024)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: {out / 'config.json'}: could not be written (File too large; ")
    assert lines[0].endswith("raise the file size limit (ulimit -f) and rerun")
    assert list(out.iterdir()) == []
