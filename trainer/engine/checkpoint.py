"""Resumable checkpoints: written atomically, verified before use, loaded without unpickling code.

A `checkpoint-0000120/` folder holds the trainable adapters, optimizer state, LR schedule, RNG states,
`state.json`, `config.json` and `manifest.json` (size and SHA-256 of every other file). It is written under a
temporary name and renamed into place, so a kill or a full disk leaves the previous checkpoint intact.
Resume verifies the manifest and reads every file; a damaged newest checkpoint gives way to the one before.
The frozen base is never written. Under DeepSpeed the engine writes its (sharded) optimizer state into
`deepspeed/` in the same folder; DeepSpeed unpickles it, so there checksums catch damage, not tampering.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from foundation.cli import InputError, first_line
from foundation.files import (  # the write-failure reporting, shared with every writer
    SaveError, free_space, publish_folder, write_failure,
)

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
STATE_FILE = "state.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.json"
ENGINE_TAG = "deepspeed"  # the DeepSpeed engine's sub-folder of a checkpoint
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
HASH_CHUNK = 1 << 20


class CheckpointError(InputError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong."""


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


# ---- RNG states as tensors and plain data ---------------------------------------------------------

def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), int(pos), int(has_gauss),
                                                                    float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- saving ---------------------------------------------------------------------------------------

def save_checkpoint(accelerator, output_dir: str | os.PathLike, step: int, model, adapters: list[str],
                    optimizer, scheduler, state: dict[str, Any], keep: int,
                    config: Optional[dict[str, Any]] = None) -> Path:
    """Write checkpoint `step` atomically (RNG states and, under DeepSpeed, engine shards from every rank).

    A failed write on any rank (a full disk) removes the `.tmp` folder and stops every rank with one SaveError
    line; the ranks agree after each part of the write, so none waits for a rank that stopped.
    """
    from trainer.engine.launch import is_deepspeed

    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    deepspeed = is_deepspeed(accelerator)
    main = accelerator.is_main_process
    unwrapped = accelerator.unwrap_model(model)

    def make_folder() -> None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
            tmp.mkdir(parents=True)

    def write_rng() -> None:
        torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")

    def write_engine() -> None:
        if deepspeed:
            model.save_checkpoint(str(tmp), tag=ENGINE_TAG, client_state={}, save_latest=False,
                                  exclude_frozen_parameters=True)

    def write_adapters() -> None:
        with gathered_trainable(accelerator, unwrapped):
            if main:
                for name in adapters:
                    unwrapped.save_adapter(name, tmp / "adapters" / name)

    def write_state() -> None:
        if main:
            if not deepspeed:
                torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            (tmp / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
            (tmp / CONFIG_FILE).write_text(json.dumps(config or {}, indent=2))
            (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))

    def publish() -> None:
        if main:
            write_manifest(tmp)
            publish_folder(tmp, final)

    # Each part is collective or must precede the next on every rank: the ranks agree after each one.
    for part in (make_folder, write_rng, write_engine, write_adapters, write_state, publish):
        failure = _agree(accelerator, _attempt(part))
        if failure is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = [p.name for p in complete_checkpoints(output_dir) if p != final]
            kept = f"; {previous[-1]} is intact" if previous else ""
            raise SaveError(f"{final}: could not be written ({failure}; {free_space(Path(output_dir))}){kept}; "
                            "free space and rerun to resume")
    if accelerator.is_main_process:
        for old in complete_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved %s", final)
    return final


def _attempt(write) -> Optional[str]:
    """Run `write`; the reason it failed when a file write failed, None when it succeeded (other errors raise)."""
    try:
        write()
    except Exception as exc:
        reason = write_failure(exc)
        if reason is None:
            raise
        return reason
    return None


def _agree(accelerator, failure: Optional[str]) -> Optional[str]:
    """Every rank learns whether any rank's write failed (and waits for the others, as a barrier would)."""
    if accelerator.num_processes == 1:
        return failure
    flag = accelerator.reduce(torch.tensor(float(failure is not None), device=accelerator.device), reduction="sum")
    return failure or ("another rank's write failed" if flag.item() > 0 else None)


def gathered_trainable(accelerator, unwrapped):
    """Under ZeRO-3 the trainable weights are partitioned: gather them (on every rank) to save them whole."""
    from trainer.engine.launch import zero_stage

    if zero_stage(accelerator) != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(unwrapped.trainable_parameters(), modifier_rank=None)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """manifest.json: size and SHA-256 of every file of the checkpoint, checked before a resume."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


# ---- verifying and choosing -----------------------------------------------------------------------

def _safe_torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused: it holds objects other than tensors and plain data, which could "
                              f"run code when loaded ({first_line(exc, 160)})") from None
    except Exception as exc:  # truncated or garbled bytes
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:160]})") from None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8, a 5,000-digit number
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


# The counts in state.json, each an integer from its least value to MAX_COUNT: a resumed run takes its step, its
# place in the data, its NaN tallies and (online RL) its update micro-batch from them. Older checkpoints may lack
# all but the step.
STATE_COUNTS = {"step": 0, "epoch": 0, "batches_in_epoch": 0, "bad_steps_in_row": 0, "bad_steps_total": 0,
                "update_micro_batch": 1}
MAX_COUNT = 2**31 - 1
GENERATOR_STATE_BYTES = torch.Generator().get_state().numel()  # online RL's minibatch order (a CPU generator)


def check_state(state: Any, file: Path) -> dict[str, Any]:
    """`state` (read from `file`) with every field in range, else CheckpointError naming the file and the field."""
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{file}: no step count in it")

    def refuse(problem: str) -> None:
        raise CheckpointError(f"{file}: {problem} (damaged or edited)")

    for key, least in STATE_COUNTS.items():
        value = state.get(key, least)
        if type(value) is not int or not least <= value <= MAX_COUNT:
            refuse(f"{key} is {json.dumps(value)[:40]}, not an integer from {least} to {MAX_COUNT}")
    if not state.get("bad_steps_in_row", 0) <= state.get("bad_steps_total", 0) <= state["step"]:
        refuse(f"bad_steps_in_row {state.get('bad_steps_in_row', 0)}, bad_steps_total "
               f"{state.get('bad_steps_total', 0)} and step {state['step']} are not in that order")
    named = _NAME.match(file.parent.name)
    if named and int(named.group(1)) != state["step"]:
        refuse(f"step is {state['step']}, but the folder is {file.parent.name}")
    order = state.get("minibatch_rng", [0] * GENERATOR_STATE_BYTES)
    if not isinstance(order, list) or len(order) != GENERATOR_STATE_BYTES or \
            any(type(b) is not int or not 0 <= b <= 255 for b in order):
        refuse(f"minibatch_rng is not a random generator's state ({GENERATOR_STATE_BYTES} bytes)")
    kl = state.get("kl_controller", {"kind": "fixed", "value": 0.0})
    value = kl.get("value") if isinstance(kl, dict) else None
    if not isinstance(kl, dict) or not isinstance(kl.get("kind"), str) or type(value) not in (int, float) or \
            not (math.isfinite(value) and value >= 0):
        refuse(f"kl_controller is {json.dumps(kl)[:60]}, not a KL coefficient (a finite number >= 0) and its kind")
    return state


def verify_checkpoint(path: Path, deepspeed: bool = False) -> dict[str, Any]:
    """Check `path` against its manifest and read every file it holds; raise CheckpointError naming a bad file.
    Returns its state.json, range-checked.

    Reading is the real test: a file with the right checksum but pickled objects in it is refused too.
    """
    from safetensors import safe_open

    path = Path(path)
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        listed = _read_json(manifest).get("files", {})
        for name, entry in listed.items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (listed in {MANIFEST_FILE})")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"{file}: {size} bytes, {entry['bytes']} when saved (truncated or damaged)")
            if _sha256(file) != entry["sha256"]:
                raise CheckpointError(f"{file}: contents differ from when it was saved (SHA-256 mismatch)")
    else:
        logger.warning("%s has no %s (saved by an older version): its files are read but not checksummed",
                       path, MANIFEST_FILE)
    state = check_state(_read_json(path / STATE_FILE), path / STATE_FILE)
    if deepspeed != (path / ENGINE_TAG).is_dir():
        if deepspeed:
            raise CheckpointError(f"{path} was not written under DeepSpeed (no {ENGINE_TAG}/ folder); resume it with "
                                  "the launch config it was saved with, or start fresh with --resume no")
        raise CheckpointError(f"{path} was written under DeepSpeed (its optimizer state is in {ENGINE_TAG}/); resume "
                              "it with the DeepSpeed launch config, or start fresh with --resume no")
    for name in (SCHEDULER_FILE, CONFIG_FILE):
        if (path / name).is_file() or name == SCHEDULER_FILE:
            _read_json(path / name)
    for rng in sorted(path.glob("rng-rank*.pt")):
        _safe_torch_load(rng)
    if not deepspeed:
        _safe_torch_load(path / OPTIMIZER_FILE)
    adapters = sorted(p for p in (path / "adapters").glob("*") if p.is_dir())
    if not adapters and not deepspeed:
        raise CheckpointError(f"{path / 'adapters'}: no saved adapter in it")
    for folder in adapters:
        for weights in [folder / "adapter_model.safetensors", *folder.glob("head.safetensors")]:
            try:
                with safe_open(str(weights), framework="pt") as f:
                    f.keys()
            except Exception as exc:
                raise CheckpointError(f"{weights}: unreadable ({type(exc).__name__}: {str(exc)[:160]})") from None
    return state


def select_checkpoint(output_dir: str | os.PathLike, resume: str, deepspeed: bool = False,
                      max_steps: Optional[int] = None) -> Optional[Path]:
    """The checkpoint a run resumes from: None for `resume='no'` or a folder without checkpoints.

    'auto' takes the newest one that verifies, warning in one line about each newer one it skips;
    an explicit folder must verify, or the run stops with the reason. Either must be at most `max_steps` in.
    """
    if resume == "no":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"--resume {resume}: not a complete checkpoint folder (no {STATE_FILE})")
        return within_run(path, verify_checkpoint(path, deepspeed)["step"], max_steps)
    candidates = complete_checkpoints(output_dir)[::-1]
    for i, path in enumerate(candidates):
        try:
            step = verify_checkpoint(path, deepspeed)["step"]
        except CheckpointError as exc:
            after = f"trying {candidates[i + 1].name}" if i + 1 < len(candidates) else "no older checkpoint is left"
            logger.warning("skipping damaged checkpoint: %s; %s", exc, after)
            continue
        return within_run(path, step, max_steps)
    if candidates:
        raise CheckpointError(f"{output_dir}: none of its {len(candidates)} checkpoints can be resumed (see the warnings "
                              "above); start over with --resume no, or pass --resume CHECKPOINT_DIR")
    return None


def within_run(path: Path, step: int, max_steps: Optional[int]) -> Path:
    """`path`, saved at `step`, unless that is past `max_steps`: then it is a point of a longer run, which this one
    would 'resume' by doing nothing, and the run stops with one line saying how to continue it."""
    if max_steps is not None and step > max_steps:
        raise CheckpointError(f"{path / STATE_FILE}: step {step}, past --max_steps {max_steps}: {path.name} is a "
                              f"checkpoint of a longer run; continue it with --max_steps above {step}, or start "
                              "over with --resume no (or another --output_dir)")
    return path


def remove_save_debris(output_dir: str | os.PathLike) -> list[str]:
    """Remove what killed saves left in `output_dir`: `checkpoint-*.tmp` folders and the hidden temporaries of
    atomic writes (`.adapter-XXXX`, `.results.json-XXXX`, ...). Only a run holding the folder's lock may call
    this: another run's save in progress would look the same."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    debris = [p for p in root.iterdir()
              if (p.name.startswith(PREFIX) and p.name.endswith(TMP_SUFFIX))
              or any(p.name.startswith(f".{name}-") for name in RUN_ARTIFACTS)]
    for path in debris:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if debris:
        logger.info("removed %s, left by a save that was killed", ", ".join(sorted(p.name for p in debris)))
    return [p.name for p in debris]


def saved_config(path: Path) -> Optional[dict[str, Any]]:
    """The run settings a checkpoint was saved under (None for checkpoints of older versions)."""
    file = Path(path) / CONFIG_FILE
    return _read_json(file) if file.is_file() else None


# Everything a stage run writes into its output folder; `--resume no` sets these aside.
RUN_ARTIFACTS = ("metrics.jsonl", "results.json", "config.json", "adapter", "tensorboard", "memory.json",
                 "memory.md", "memory.png")


def _aside_folder(root: Path) -> Path:
    target = root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while target.exists():
        n += 1
        target = root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    target.mkdir()
    return target


def set_aside_previous_run(output_dir: str | os.PathLike) -> Optional[Path]:
    """Move an earlier run's checkpoints and outputs into `previous-<time>/` inside `output_dir`.

    A run started with `--resume no` must never later resume, report or publish what another run left.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) or p.name in RUN_ARTIFACTS]
    if not found:
        return None
    target = _aside_folder(root)
    for p in found:
        os.replace(p, target / p.name)
    logger.warning("--resume no: moved the earlier run's %d checkpoint(s) and outputs in %s to %s",
                   sum(p.name.startswith(PREFIX) for p in found), root, target)
    return target


def set_aside_newer(output_dir: str | os.PathLike, resume_from: Path) -> Optional[Path]:
    """Move the checkpoints newer than the one a run resumes from (damaged ones it skipped, or a later
    point of the run it rewinds) into `previous-<time>/`: pruning keeps the highest steps, and would
    otherwise delete the new checkpoints and keep these."""
    step = int(_NAME.match(Path(resume_from).name).group(1)) if _NAME.match(Path(resume_from).name) else None
    root = Path(output_dir)
    newer = [p for p in root.iterdir() if _NAME.match(p.name) and step is not None
             and int(_NAME.match(p.name).group(1)) > step] if root.is_dir() else []
    if not newer:
        return None
    target = _aside_folder(root)
    for p in newer:
        os.replace(p, target / p.name)
    logger.warning("resuming from step %d: moved %d newer checkpoint(s) of %s to %s", step, len(newer), root, target)
    return target


# ---- loading --------------------------------------------------------------------------------------

# The per-parameter optimizer state shaped as its parameter (torch's AdamW, bitsandbytes' 8-bit AdamW).
MOMENTS = ("exp_avg", "exp_avg_sq", "state1", "state2")


def optimizer_mismatch(optimizer, saved: Any) -> Optional[str]:
    """How a saved optimizer state differs from `optimizer`'s parameters (groups, their sizes, the moments'
    shapes), in a few words; None when it fits."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        return "not an optimizer state (no parameter groups)"
    saved_sizes = [len(g["params"]) for g in groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        return (f"parameter groups of {saved_sizes} tensors saved, {sizes} here: the optimizer state's shapes do not "
                "fit this model's trainable parameters")
    params = dict(zip((i for g in groups for i in g["params"]),
                      (p for g in optimizer.param_groups for p in g["params"])))
    state = saved.get("state") if isinstance(saved.get("state"), dict) else {}
    for index, values in state.items():
        for key in MOMENTS:
            moment = values.get(key) if isinstance(values, dict) else None
            param = params.get(index)
            if isinstance(moment, torch.Tensor) and param is not None and moment.dim() == param.dim() and \
                    moment.shape != param.shape:
                return (f"{key} of parameter {index} is {list(moment.shape)}, the parameter {list(param.shape)}: the "
                        "optimizer state's shapes do not fit this model's trainable parameters")
    return None


def other_weights(path: Path, problem: str) -> str:
    """The one line of a checkpoint whose weights are not this model's: resumed with another base or LoRA
    setting (which --resume_config_check false lets through)."""
    saved = saved_config(path)
    model = saved.get("model") if isinstance(saved, dict) and isinstance(saved.get("model"), dict) else {}
    settings = ", ".join(f"{k}={model[k]}" for k in ("model_name_or_path", "preset_overrides", "lora_r",
                                                       "lora_target_modules") if model.get(k) is not None)
    was = f" ({settings})" if settings else ""
    return (f"{path}: its weights do not fit this model ({problem}): it was saved with another base or LoRA "
            f"settings{was}; resume with those, or start over with --resume no")


def load_checkpoint(accelerator, path: Path, model, adapters: list[str], optimizer, scheduler) -> dict[str, Any]:
    """Restore adapters, optimizer, scheduler and this rank's RNG from a verified `path`; return its state.json.

    Every file is read before anything is changed, so a failure leaves the model and optimizer as they were.
    """
    from trainer.engine.launch import is_deepspeed
    from trainer.model.shared_base import apply_adapter_weights, read_adapter_weights, weights_mismatch

    path = Path(path)
    deepspeed = is_deepspeed(accelerator)
    scheduler_state = _read_json(path / SCHEDULER_FILE)
    state = check_state(_read_json(path / STATE_FILE), path / STATE_FILE)
    rng_file = path / f"rng-rank{accelerator.process_index}.pt"
    rng = _safe_torch_load(rng_file) if rng_file.is_file() else None
    if deepspeed:
        # Trainable weights and optimizer state (with its fp32 master copy), each rank its own shard.
        loaded, _ = model.load_checkpoint(str(path), tag=ENGINE_TAG, load_module_strict=False)
        if loaded is None:
            raise CheckpointError(f"{path / ENGINE_TAG}: DeepSpeed could not load the engine state")
    else:
        unwrapped = accelerator.unwrap_model(model)
        weights = {name: read_adapter_weights(path / "adapters" / name) for name in adapters}
        optimizer_state = _safe_torch_load(path / OPTIMIZER_FILE)
        problem = next((f"adapters/{name}: {why}" for name, (lora, head) in weights.items()
                        if (why := weights_mismatch(unwrapped, name, lora, head))), None)
        if problem is None and (why := optimizer_mismatch(optimizer, optimizer_state)):
            problem = f"{OPTIMIZER_FILE}: {why}"
        if problem:  # checked before anything is loaded: a mismatch leaves the model and optimizer as they were
            raise CheckpointError(other_weights(path, problem))
        for name, (lora, head) in weights.items():
            apply_adapter_weights(unwrapped, name, lora, head, source=path / "adapters" / name)
        optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    if rng is not None:
        set_rng_state(rng)
    else:
        logger.warning("%s has no RNG state for rank %d (saved with another process count)", path,
                       accelerator.process_index)
    logger.info("resumed from %s (step %d)", path, state["step"])
    return state
