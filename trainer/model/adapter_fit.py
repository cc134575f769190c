"""Whether a saved adapter belongs to the base it is about to be loaded onto.

A stage records its base beside the adapter it saves (`base_model.json`: the model settings, the base's
shape and a fingerprint of its embedding weights); a checkpoint's adapter has no such file, and the run
settings in the checkpoint's `config.json` stand in for it. Before any adapter is loaded its record is
compared with the base, and its LoRA (and head) weight shapes with the base's layers, so an adapter of
another base stops in one line instead of loading silently or failing with a size-mismatch traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from foundation.cli import InputError

logger = logging.getLogger(__name__)

HEAD_FILE = "head.safetensors"  # a scalar head (value, reward) beside its adapter
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"  # peft's older format, a pickle: refused, never unpickled
BASE_MODEL_FILE = "base_model.json"  # beside a saved adapter: how to rebuild the base it sits on
RUN_CONFIG_FILE = "config.json"  # a run's (and a checkpoint's) settings, with the model's in section "model"
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size")
FINGERPRINT_VALUES = 16
FINGERPRINT_RTOL = 1e-2  # wide enough for the same weights loaded in bf16, fp16 or fp32
_LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None


def saved_base(adapter_dir: str | os.PathLike) -> tuple[dict[str, Any], Optional[Path]]:
    """The record of the base an adapter was trained on, and the file it came from: its base_model.json,
    else (a checkpoint's `adapters/NAME`, or a stage folder's adapter) the run's config.json above it.
    ({}, None) when neither exists."""
    folder = Path(adapter_dir)
    own = folder / BASE_MODEL_FILE
    if own.is_file():
        values = _read_json(own)
        if not isinstance(values, dict):
            raise InputError(f"{own}: expected a JSON object of model settings")
        return values, own
    run = folder.parent.parent if folder.parent.name == "adapters" else folder.parent
    config = run / RUN_CONFIG_FILE
    if config.is_file():
        values = _read_json(config)
        if isinstance(values, dict) and isinstance(values.get("model"), dict):
            return dict(values["model"]), config
    return {}, None


def base_shape(causal_lm: torch.nn.Module) -> dict[str, int]:
    config = causal_lm.config
    return {key: getattr(config, key) for key in SHAPE_KEYS if isinstance(getattr(config, key, None), int)}


def base_fingerprint(causal_lm: torch.nn.Module) -> Optional[list[float]]:
    """A few input-embedding values spread over the matrix: cheap, alike in every dtype and quantization
    the project loads a base in (embeddings are never 4-bit), and different for other weights. None
    where the matrix is not whole on this process (a ZeRO-3 / FSDP shard, a meta tensor)."""
    embeddings = causal_lm.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    shape = base_shape(causal_lm)
    if weight is None or weight.device.type == "meta" or weight.dim() != 2 or \
            weight.shape[0] != shape.get("vocab_size", weight.shape[0]) or weight.numel() == 0:
        return None
    flat = weight.detach().reshape(-1)
    index = (torch.arange(FINGERPRINT_VALUES) * (flat.numel() - 1) // (FINGERPRINT_VALUES - 1)).to(flat.device)
    return [float(v) for v in flat[index].float().cpu()]


def base_identity(causal_lm: torch.nn.Module) -> dict[str, Any]:
    """What base_model.json records about the base itself, for `check_adapter_fits` to compare."""
    return {"base_shape": base_shape(causal_lm), "base_fingerprint": base_fingerprint(causal_lm)}


def _shape_text(shape: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def check_recorded_base(folder: Path, record: dict[str, Any], source: Optional[Path], causal_lm: torch.nn.Module,
                        name: str, what: str) -> None:
    """The base shape and fingerprint an adapter's record holds (when it holds them) are this base's."""
    trained_on = record.get("model_name_or_path", "?")
    saved_shape = record.get("base_shape")
    if isinstance(saved_shape, dict):
        shape = base_shape(causal_lm)
        differ = {k: v for k, v in saved_shape.items() if k in shape and shape[k] != v}
        if differ:
            raise InputError(f"{what}: {folder} was trained on {trained_on} with {_shape_text(differ)} ({source}), "
                             f"this base ({name}) has {_shape_text({k: shape[k] for k in differ})}: load it onto "
                             "the base it was trained on")
    saved_print = record.get("base_fingerprint")
    mine = base_fingerprint(causal_lm)
    if isinstance(saved_print, list) and mine is not None and len(saved_print) == len(mine):
        saved_t, mine_t = torch.tensor(saved_print, dtype=torch.float32), torch.tensor(mine)
        if not torch.allclose(mine_t, saved_t, rtol=FINGERPRINT_RTOL, atol=1e-6):
            other = f" (trained on {trained_on})" if trained_on != name else ""
            raise InputError(f"{what}: {folder} was trained on other base weights than this base's ({name}): the "
                             f"embedding fingerprint in {source} differs{other}; load it onto the base it was "
                             "trained on")
    elif saved_shape is None and trained_on not in ("?", name):
        logger.warning("%s: %s was saved for base %s, loading it onto %s (its record has no shape to check)",
                       what, folder, trained_on, name)


def check_lora_shapes(folder: Path, causal_lm: torch.nn.Module, name: str, what: str) -> None:
    """Every LoRA weight in the adapter's safetensors file has a layer of this base, of the right size
    (read from the file's header: no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open


    weights = folder / WEIGHTS_FILE
    if not weights.is_file():  # check_adapter_folder refuses a folder without it
        return
    modules = dict(causal_lm.named_modules())
    rank_of = config_ranks(folder)
    shape = base_shape(causal_lm)
    try:
        with safe_open(str(weights), "pt") as f:
            shapes = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise InputError(f"{what}: {weights} is not a readable safetensors file ({exc})") from None
    for key, size in shapes.items():
        match = _LORA_KEY.match(key)
        if match is None:
            continue
        path, side = match.groups()
        rank = rank_of(path)
        if rank is not None and len(size) == 2 and size[0 if side == "A" else 1] != rank:
            needs = [rank, size[1]] if side == "A" else [size[0], rank]
            raise InputError(f"{what}: {folder} does not match its adapter_config.json: {path} lora_{side} is {size} "
                             f"in {WEIGHTS_FILE}, rank r={rank} there needs {needs}; save the adapter again, or "
                             "fix 'r' in adapter_config.json")
        layer = modules.get(path)
        if layer is None:
            layers = f", {shape['num_hidden_layers']} layers" if "num_hidden_layers" in shape else ""
            raise InputError(f"{what}: {weights} holds LoRA weights for {path}, a layer this base ({name}{layers}) "
                             "does not have: the adapter was trained on another base")
        ins, outs = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
        if not isinstance(ins, int) or not isinstance(outs, int) or len(size) != 2:
            continue
        expected = (size[0], ins) if side == "A" else (outs, size[1])  # A: (rank, in), B: (out, rank)
        if tuple(size) != expected:
            raise InputError(f"{what}: {weights} does not fit this base ({name}): {path} lora_{side} is {size}, "
                             f"this base's layer needs {list(expected)}: the adapter was trained on another base")
    head = folder / HEAD_FILE
    hidden = shape.get("hidden_size")
    if head.is_file() and hidden is not None:
        try:
            with safe_open(str(head), "pt") as f:
                width = f.get_slice("linear.weight").get_shape()[-1] if "linear.weight" in f.keys() else hidden
        except (OSError, SafetensorError) as exc:
            raise InputError(f"{what}: {head} is not a readable safetensors file ({exc})") from None
        if width != hidden:
            raise InputError(f"{what}: {head} takes hidden states of size {width}, this base ({name}) has "
                             f"hidden_size={hidden}: the head was trained on another base")


def config_ranks(folder: Path):
    """The LoRA rank adapter_config.json gives each layer ('r', or its 'rank_pattern' entry, matched as peft
    matches it): a function of the layer's name, None where the config gives no integer."""
    from peft.utils.other import get_pattern_key

    values = _read_json(folder / "adapter_config.json")
    values = values if isinstance(values, dict) else {}
    pattern = values.get("rank_pattern") if isinstance(values.get("rank_pattern"), dict) else {}

    def rank(layer: str) -> Optional[int]:
        try:
            value = pattern.get(get_pattern_key(list(pattern), layer), values.get("r"))
        except re.error:  # a pattern that is no regular expression: peft's loading says so
            return None
        return value if type(value) is int else None

    return rank


def check_adapter_fits(folder: str | os.PathLike, causal_lm: torch.nn.Module, name: str, what: str) -> None:
    """Refuse, in one line naming the file, an adapter saved for another base than `causal_lm` (loaded as
    `name`): by its recorded shape and fingerprint where it has them, and by its weight shapes always."""
    folder = Path(folder)
    record, source = saved_base(folder)
    check_recorded_base(folder, record, source, causal_lm, name, what)
    check_lora_shapes(folder, causal_lm, name, what)
