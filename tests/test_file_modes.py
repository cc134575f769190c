"""What the project publishes (atomic files, atomic folders, checkpoints, exports) gets the user's normal
modes, 0666 / 0777 less the umask, so another user (an inference server) can read it: including the files
that torch and safetensors wrote inside a folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from foundation.files import atomic_folder, write_atomic

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
# umask -> (file mode, folder mode)
EXPECTED = {0o022: (0o644, 0o755), 0o002: (0o664, 0o775)}


@pytest.fixture(params=sorted(EXPECTED), ids=lambda m: f"umask{m:03o}")
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Mode bits of `root` ('.') and of everything below it, by relative path."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *sorted(root.rglob("*"))]}


def expected_modes(root: Path, umask: int) -> dict[str, int]:
    file_mode, folder_mode = EXPECTED[umask]
    return {str(p.relative_to(root)): folder_mode if p.is_dir() else file_mode for p in [root, *sorted(root.rglob("*"))]}


def test_write_atomic_gives_the_file_the_umask_modes(tmp_path, umask):
    path = write_atomic(tmp_path / "results.json", "{}")
    assert stat.S_IMODE(path.stat().st_mode) == EXPECTED[umask][0]
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_published_folder_and_what_torch_and_safetensors_wrote_get_the_umask_modes(tmp_path, umask):
    from safetensors.torch import save_file

    with atomic_folder(tmp_path / "adapter") as tmp:
        (tmp / "sub").mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "adapter_model.safetensors"))  # safetensors: 0600
        torch.save({"w": torch.zeros(2)}, tmp / "optimizer.pt")
    got = modes(tmp_path / "adapter")
    assert set(got) == {".", "sub", "sub/adapter_model.safetensors", "optimizer.pt"}
    assert got == expected_modes(tmp_path / "adapter", umask)


def test_a_tiny_runs_checkpoint_adapter_and_export_get_the_umask_modes(tmp_path, umask):
    from conftest import in_process_command

    from trainer.export import main as export

    out = tmp_path / "run"
    proc = in_process_command("trainer.sft", ["--config", str(TINY_SFT), "--output_dir", str(out), "--eval_every", "0",
                                              "--max_steps", "1", "--save_every", "1"])  # under the fixture's umask
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checkpoint = out / "checkpoint-0000001"
    assert (checkpoint / "adapters" / "policy" / "adapter_model.safetensors").is_file()
    assert modes(checkpoint) == expected_modes(checkpoint, umask)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert modes(out / "adapter") == expected_modes(out / "adapter", umask)
    for name in ("results.json", "config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == EXPECTED[umask][0], name

    exported = export(["--adapter", str(out / "adapter"), "--out", str(tmp_path / "export")])
    assert (exported / "model.safetensors").is_file() and (exported / "export.json").is_file()
    assert modes(exported) == expected_modes(exported, umask)
