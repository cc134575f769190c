"""Resumable checkpoints, written atomically.

A checkpoint is a folder `checkpoint-0000120/` holding the trainable adapters (PEFT format plus
heads), the optimizer and scheduler states, every rank's RNG states and `state.json` (step, data
position, counters, stage extras). It is written under a temporary name and renamed into place, so
a kill during the write leaves only a `.tmp` folder that resume ignores and the next save removes:
the newest complete checkpoint is always readable.

The frozen base is never written: it is reloaded from its source on resume.

Under DeepSpeed the optimizer state lives in the engine (sharded across ranks under ZeRO), so the
engine writes it, from every rank, into `deepspeed/` inside the same temporary folder (trainable
weights only: `exclude_frozen_parameters`), and the rename publishes it with the rest. The LR
schedule is ours in every mode (scheduler.pt).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
STATE_FILE = "state.json"
ENGINE_TAG = "deepspeed"  # the DeepSpeed engine's sub-folder of a checkpoint
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
    """Write checkpoint `step` atomically (RNG states and, under DeepSpeed, engine shards from every rank)."""
    from trainer.launch import is_deepspeed

    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    deepspeed = is_deepspeed(accelerator)
    if deepspeed:
        model.save_checkpoint(str(tmp), tag=ENGINE_TAG, client_state={}, save_latest=False,
                              exclude_frozen_parameters=True)
    unwrapped = accelerator.unwrap_model(model)
    with gathered_trainable(accelerator, unwrapped):
        if accelerator.is_main_process:
            for name in adapters:
                unwrapped.save_adapter(name, tmp / "adapters" / name)
    if accelerator.is_main_process:
        if not deepspeed:
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


def gathered_trainable(accelerator, unwrapped):
    """Under ZeRO-3 the trainable weights are partitioned: gather them (on every rank) to save them whole."""
    from trainer.launch import zero_stage

    if zero_stage(accelerator) != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(unwrapped.trainable_parameters(), modifier_rank=None)


def load_checkpoint(accelerator, path: Path, model, adapters: list[str], optimizer, scheduler) -> dict[str, Any]:
    """Restore adapters, optimizer, scheduler and this rank's RNG from `path`; return its state.json."""
    from trainer.launch import is_deepspeed
    from trainer.shared_base import load_adapter_weights

    if is_deepspeed(accelerator):
        if not (path / ENGINE_TAG).is_dir():
            raise FileNotFoundError(f"{path} was not written under DeepSpeed (no {ENGINE_TAG}/ folder); resume it "
                                    "with the launch config it was saved with, or start fresh with --resume no")
        # Trainable weights and optimizer state (with its fp32 master copy), each rank its own shard.
        loaded, _ = model.load_checkpoint(str(path), tag=ENGINE_TAG, load_module_strict=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {path / ENGINE_TAG}")
    else:
        if (path / ENGINE_TAG).is_dir():
            raise FileNotFoundError(f"{path} was written under DeepSpeed (its optimizer state is in {ENGINE_TAG}/); "
                                    "resume it with the DeepSpeed launch config, or start fresh with --resume no")
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
