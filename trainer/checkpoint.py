"""Resumable checkpoints, written atomically.

A checkpoint is a folder `checkpoint-0000120/` holding the trainable adapters (PEFT format plus
heads), the optimizer and scheduler states, every rank's RNG states and `state.json` (step, data
position, counters, stage extras). It is written under a temporary name and renamed into place, so
a kill during the write leaves only a `.tmp` folder that resume ignores and the next save removes:
the newest complete checkpoint is always readable.

The frozen base is never written: it is reloaded from its source on resume.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
STATE_FILE = "state.json"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}{step:07d}"


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (renamed into place, state.json present), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Optional[Path]:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(accelerator, output_dir: str | os.PathLike, step: int, model, adapters: list[str],
                    optimizer, scheduler, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` atomically on the main process (RNG states from every rank)."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        for name in adapters:
            unwrapped.save_adapter(name, tmp / "adapters" / name)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved %s", final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path, model, adapters: list[str], optimizer, scheduler) -> dict[str, Any]:
    """Restore adapters, optimizer, scheduler and this rank's RNG from `path`; return its state.json."""
    from trainer.shared_base import load_adapter_weights

    unwrapped = accelerator.unwrap_model(model)
    for name in adapters:
        load_adapter_weights(unwrapped, name, path / "adapters" / name)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng_file = path / f"rng-rank{accelerator.process_index}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s has no RNG state for rank %d (saved with another process count)", path,
                       accelerator.process_index)
    state = json.loads((path / STATE_FILE).read_text())
    logger.info("resumed from %s (step %d)", path, state["step"])
    return state


def _fsync_tree(root: Path) -> None:
    """Flush every file so the rename never publishes data still in the page cache only."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
