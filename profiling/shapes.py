"""Model shapes and the exact byte counts of what a model holds: base weights, NF4 constants, LoRA.

Closed forms of what the trainer allocates (checked against the tensor walk in tests), so the estimator's
resident components are exact. NF4 with double quantization costs 0.5 + 1/64 + 1/4096 bytes per weight plus
1,092 bytes per layer (the layout: docs/memory.md, "NF4 bytes per linear layer"); lm_head, embeddings and
norms stay in the compute dtype; LoRA weights are fp32: r x (in + out) per target.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from foundation.cli import InputError, UsageError, first_line

logger = logging.getLogger(__name__)

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
NF4_BLOCK = 64
NESTED_BLOCK = 256
CODEBOOK_BYTES = 16 * 4
NESTED_CODEBOOK_BYTES = 256 * 4
OFFSET_BYTES = 4
LORA_BYTES = 4
SMOLLM2_TOKENIZER_VOCAB = 49152  # presets without a vocab of their own use SmolLM2's tokenizer

# Architecture presets built with random weights, for memory and speed work (no download needed).
PRESETS: dict[str, dict] = {
    "tiny-llama": dict(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-2-7b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "llama-2-13b": dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # The families users bring today, with their real shapes (meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B,
    # mistralai/Mistral-7B-v0.3 config.json): grouped-query attention (8 or 4 KV heads), large vocabularies,
    # Qwen2's q/k/v biases. Rope scaling is left out: it changes no tensor's size.
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}
# Real models the project knows by name (the embedded default), as their config.json says; a test
# checks this against the converted model, so the estimator needs no conversion to size it.
KNOWN_MODELS: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
}
# Hub ids whose config.json has a preset's (or a known model's) shape: offline, with no copy in the local
# Hugging Face cache, the estimator sizes them by that preset. Matched case-insensitively, as the hub does.
HUB_SHAPES: dict[str, str] = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b", "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/Llama-2-13b-hf": "llama-2-13b", "meta-llama/Llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Meta-Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "mistralai/Mistral-7B-v0.3": "mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3": "mistral-7b",
    "HuggingFaceTB/SmolLM2-135M": "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
}


@dataclass(frozen=True)
class ModelShape:
    """The figures of a Llama-architecture decoder that decide its memory."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q, k and v (Llama's attention_bias: on o as well)
    o_bias: bool = False
    model_type: str = "llama"  # its config's: which transformers class it loads as (its attention support)

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        qwen2, llama_bias = cfg.get("model_type") == "qwen2", bool(cfg.get("attention_bias", False))
        return cls(
            name=name, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or llama_bias, o_bias=llama_bias and not qwen2, model_type=cfg.get("model_type", "llama"),
        )

    def bias_params(self) -> int:
        """Bias weights of all the layers' linears (they stay in the compute dtype under NF4)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * ((q + 2 * kv) * self.qkv_bias + self.hidden_size * self.o_bias)

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of each linear layer in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]

    def linear_params(self) -> int:
        return self.num_layers * sum(a * b for _, a, b in self.linears())

    def total_params(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params() + embed + norms + self.bias_params()

    def to_dict(self) -> dict:
        return asdict(self)


def preset_config(name: str, vocab_size: int, overrides: Optional[str] = None):
    """The transformers config (LlamaConfig, Qwen2Config, MistralConfig) of an architecture preset;
    `overrides` like 'num_hidden_layers=4,hidden_size=128'."""
    from transformers import AutoConfig

    from foundation.cli import parse_assignments

    values = dict(PRESETS[name])
    config_class = type(AutoConfig.for_model(values.pop("model_type", "llama")))
    values.setdefault("vocab_size", vocab_size)
    defaults = config_class()
    for key, raw in parse_assignments(overrides, "preset_overrides").items():
        if not hasattr(defaults, key):
            raise UsageError(f"--preset_overrides: '{key}' is not a {config_class.__name__} field")
        default = getattr(defaults, key)
        try:
            values[key] = (raw.lower() in ("1", "true", "yes") if isinstance(default, bool)
                           else type(default)(raw) if isinstance(default, (int, float)) else raw)
        except ValueError:
            raise UsageError(f"--preset_overrides: {key}={raw} is not a {type(default).__name__}") from None
        number = values[key]
        if isinstance(number, (int, float)) and not isinstance(number, bool) and not (
                math.isfinite(number) and (number > 0 or key.endswith(("dropout", "_id", "bias")))):
            raise UsageError(f"--preset_overrides: {key}={raw} must be a finite number greater than 0")
    return config_class(**values)


# The config.json fields a shape is built from (the optional ones default from the others).
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim")


def read_model_config(config_file: Path, given: Optional[dict] = None) -> dict:
    """A model folder's config.json, with the `given` fields (flags) over its own, as a dict whose shape fields
    are positive integers; else InputError naming the file and the field."""
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or UTF-8
        raise InputError(f"{config_file}: not a readable JSON file ({type(exc).__name__}: {first_line(exc, 160)})") \
            from None
    if not isinstance(cfg, dict):
        raise InputError(f"{config_file}: expected a JSON object of model settings, found a {type(cfg).__name__}")
    cfg.update(given or {})
    for key in REQUIRED_FIELDS + OPTIONAL_FIELDS:
        value = cfg.get(key)
        if key in REQUIRED_FIELDS and value is None:
            raise InputError(f"{config_file}: no '{key}' in it (a Llama-architecture decoder is sized from "
                             f"{', '.join(REQUIRED_FIELDS)}): add it, or give the whole shape with --hidden_size, "
                             "--intermediate_size, --num_layers, --num_heads and --vocab_size")
        if value is not None and (type(value) is not int or value < 1):
            raise InputError(f"{config_file}: '{key}' is {json.dumps(value)[:40]}, not a positive integer")
    return cfg


def hub_offline() -> bool:
    """Whether the hub may not be asked (the variables huggingface_hub and transformers read)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def is_hub_id(name: str) -> bool:
    """`owner/name` as the hub spells a model id, and no local path of that name."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or name.startswith((".", "~")) or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_unreachable(timeout_s: float = 3.0) -> Optional[str]:
    """Why the hub's host takes no connection within `timeout_s`, else None: without a network the download
    would retry for most of a minute before failing."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError as exc:
        return f"{url.hostname}: {first_line(exc, 80)}"
    return None


@functools.cache
def hub_config(repo_id: str) -> tuple[Optional[Path], str]:
    """(the config.json of hub model `repo_id`: from the local Hugging Face cache, else from the hub when online;
    None and why not). Asked once per process."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached), "cached"
    if hub_offline():
        return None, "not in the local Hugging Face cache and the hub is offline (HF_HUB_OFFLINE)"
    unreachable = hub_unreachable()
    if unreachable:
        return None, f"not in the local Hugging Face cache and the hub is unreachable ({unreachable})"
    try:
        return Path(hf_hub_download(repo_id, "config.json", etag_timeout=10)), "downloaded"
    except Exception as exc:  # no network, a gated or missing repo: each is said, then the preset or one line
        return None, f"not in the local Hugging Face cache and the hub did not give it ({first_line(exc, 160)})"


def hub_shape_config(repo_id: str, vocab_size: Optional[int], overrides: Optional[str]) -> dict:
    """A hub model's config: its config.json (cache or hub), else the preset of the same shape, said in one line;
    else UsageError saying how to give the model."""
    config_file, why = hub_config(repo_id)
    if config_file is not None:
        return read_model_config(config_file, {} if vocab_size is None else {"vocab_size": vocab_size})
    preset = {k.lower(): v for k, v in HUB_SHAPES.items()}.get(repo_id.lower())
    if preset is None:
        raise UsageError(f"model '{repo_id}': its config.json is {why}. Give a folder holding it (huggingface-cli "
                         f"download {repo_id} config.json --local-dir DIR, then --model_name_or_path DIR), "
                         f"or a preset ({', '.join(PRESETS)})")
    said_once(f"model '{repo_id}': config.json {why}; sizing it as the '{preset}' preset, which has its shape")
    return preset_config(preset, vocab_size or SMOLLM2_TOKENIZER_VOCAB, overrides).to_dict() if preset in PRESETS \
        else dict(KNOWN_MODELS[preset])


@functools.cache
def said_once(line: str) -> None:
    logger.warning(line)


def load_shape(model: str, vocab_size: Optional[int] = None, overrides: Optional[str] = None) -> ModelShape:
    """Shape of a preset ('tiny-llama', 'llama-2-7b', ...), the embedded 'smollm2-135m', an HF folder or a hub id
    (`hub_shape_config`)."""
    if model in PRESETS:
        cfg = preset_config(model, vocab_size or SMOLLM2_TOKENIZER_VOCAB, overrides).to_dict()
    elif model in KNOWN_MODELS:
        cfg = dict(KNOWN_MODELS[model])
    elif (Path(model).expanduser() / "config.json").is_file():
        cfg = read_model_config(Path(model).expanduser() / "config.json",
                                {} if vocab_size is None else {"vocab_size": vocab_size})
    elif is_hub_id(model):
        cfg = hub_shape_config(model, vocab_size, overrides)
    else:
        raise UsageError(f"unknown model '{model}': use a preset ({', '.join(PRESETS)}), "
                         f"{', '.join(KNOWN_MODELS)}, a folder holding a Hugging Face config.json, "
                         "or a hub id like meta-llama/Llama-2-7b-hf")
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return ModelShape.from_config(model, cfg)


# ---------------------------------------------------------------- base model


def nf4_bytes(n: int, double_quant: bool = True) -> tuple[int, int]:
    """(packed weight bytes, quantization constant bytes) of one NF4 linear layer of n weights."""
    blocks = math.ceil(n / NF4_BLOCK)
    packed = math.ceil(n / 2)
    if not double_quant:
        return packed, 4 * blocks + CODEBOOK_BYTES
    nested = 4 * math.ceil(blocks / NESTED_BLOCK)
    return packed, blocks + nested + OFFSET_BYTES + CODEBOOK_BYTES + NESTED_CODEBOOK_BYTES


def base_bytes(shape: ModelShape, quantization: str, dtype_bytes: int, double_quant: bool = True) -> dict[str, int]:
    """base_weights, base_quant_constants and base_other of the frozen base, in bytes."""
    weights = constants = 0
    for _, a, b in shape.linears():
        if quantization == "nf4":
            packed, consts = nf4_bytes(a * b, double_quant)
            weights, constants = weights + packed, constants + consts
        else:
            weights += a * b * dtype_bytes
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    norms = (2 * shape.num_layers + 1) * shape.hidden_size
    rotary = 2 * (shape.head_dim // 2) * 4  # inv_freq and original_inv_freq, fp32
    out = {"base_weights": weights * shape.num_layers,
           "base_other": (embeddings + norms + shape.bias_params()) * dtype_bytes + rotary}
    if quantization == "nf4":
        out["base_quant_constants"] = constants * shape.num_layers
    return out


# ---------------------------------------------------------------- LoRA and heads


def lora_targets(shape: ModelShape, targets: str) -> list[tuple[str, int, int]]:
    """The linear layers of one decoder layer that get LoRA: 'all-linear' or a comma list of names."""
    if targets == "all-linear":
        return shape.linears()
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = sorted(set(wanted) - set(LLAMA_LINEARS))
    if unknown:
        raise UsageError(f"unknown LoRA target(s) {unknown}; Llama linear layers are {', '.join(LLAMA_LINEARS)}")
    return [lin for lin in shape.linears() if lin[0] in wanted]


def lora_tensor_sizes(shape: ModelShape, rank: int, targets: str) -> list[int]:
    """Element counts of one adapter's tensors (lora_A: r x in, lora_B: out x r), all layers."""
    per_layer = []
    for _, a, b in lora_targets(shape, targets):
        per_layer += [rank * a, b * rank]
    return per_layer * shape.num_layers


def head_tensor_sizes(shape: ModelShape) -> list[int]:
    """A scalar head: Linear(hidden, 1) in fp32, weight and bias."""
    return [shape.hidden_size, 1]
