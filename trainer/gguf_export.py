"""A merged causal LM as one GGUF file, the format llama.cpp and Ollama run: its weights in f32, f16, bf16 or
Q8_0, and in its metadata the shape, the tokenizer (vocabulary, merges, token types, special ids) and the
chat template, under llama.cpp's key names.

Llama, Mistral (llama.cpp runs it as llama) and Qwen2 are written. The file is produced with the `gguf`
package's writer and quantizers; the tensor names and the metadata are this module's.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from foundation.cli import InputError, UsageError

logger = logging.getLogger(__name__)

# --gguf_type: (GGML type of the 2-D weights, general.file_type). Norms and biases stay F32 in every type.
GGUF_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
              "q8_0": ("Q8_0", "MOSTLY_Q8_0")}
# transformers model_type -> GGUF architecture. llama.cpp runs Mistral as llama (its sliding window aside).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
MODEL_FILE = "model.gguf"

_TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Pre-tokenizer splits llama.cpp knows by name (tokenizer.ggml.pre), as tokenizer.json writes them: Llama 3's
# and Qwen2's differ only in how many digits one piece takes.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {_SPLIT.replace("DIGITS", r"\p{N}{1,3}"): "llama-bpe", _SPLIT.replace("DIGITS", r"\p{N}"): "qwen2"}


def gguf_architecture(config) -> str:
    """The GGUF architecture of a transformers config; one line naming what is supported otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UsageError(f"--format gguf: the base is a {model_type} model; GGUF export writes "
                         f"{', '.join(ARCHITECTURES)} (export a Hugging Face folder, --format hf, and convert it with "
                         "llama.cpp's convert_hf_to_gguf.py)")
    return ARCHITECTURES[model_type]


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name of a transformers Llama/Mistral/Qwen2 tensor ('model.layers.3.mlp.up_proj.weight' ->
    'blk.3.ffn_up.weight')."""
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.{kind}"
    layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if layer and layer.group(2) in _LAYER_TENSORS:
        return f"blk.{layer.group(1)}.{_LAYER_TENSORS[layer.group(2)]}.{kind}"
    raise InputError(f"--format gguf: the model has a tensor {name} that GGUF export does not know; export a "
                     "Hugging Face folder (--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py")


def interleave_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection's rows (weight or bias) in llama.cpp's rotary order for the llama architecture.

    transformers rotates dimension i of a head together with dimension i + d/2; llama.cpp's llama rotates the
    adjacent pair (2i, 2i + 1). Moving row i of each head to 2i and row i + d/2 to 2i + 1 makes both compute
    the same attention (Qwen2 rotates halves in llama.cpp too, and is written as it is)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---- tokenizer ------------------------------------------------------------------------------------

@dataclass
class Vocabulary:
    """A tokenizer as GGUF metadata: `model` is llama.cpp's tokenizer kind (gpt2: byte-level BPE; llama:
    SentencePiece BPE with byte fallback)."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: Optional[list[float]] = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: Optional[bool] = None
    chat_template: object = None  # str, or a list of {name, template}


def _pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for a byte-level tokenizer's pre-tokenizer (how text is split before the merges)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    kinds = [step.get("type") for step in steps]
    splits = [step.get("pattern", {}).get("Regex") for step in steps if step.get("type") == "Split"]
    if splits and splits[0] in _SPLITS:
        return _SPLITS[splits[0]]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    logger.warning("--format gguf: the tokenizer's pre-tokenizer (%s) has no llama.cpp name: written as 'default', "
                   "so llama.cpp may split text differently; check its tokens of a sample", json.dumps(pre)[:200])
    return "default"


def _adds_special(tokenizer) -> tuple[bool, bool]:
    """Whether encoding adds the BOS, the EOS token (what the tokenizer does, not what its config says)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    bos = len(full) > len(plain) and tokenizer.bos_token_id is not None and full[0] == tokenizer.bos_token_id
    eos = len(full) > len(plain) and tokenizer.eos_token_id is not None and full[-1] == tokenizer.eos_token_id
    return bos, eos


def vocabulary(tokenizer, rows: int) -> Vocabulary:
    """The tokenizer of the export as GGUF metadata for a model of `rows` embedding rows (ids past the
    tokenizer's are written as unused [PADi] tokens, as llama.cpp needs one token per row)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UsageError("--format gguf: the tokenizer is not a fast (tokenizer.json) tokenizer, which GGUF export "
                         "reads; export a Hugging Face folder (--format hf)")
    spec = json.loads(backend.to_str())
    bpe = spec.get("model", {})
    vocab = tokenizer.get_vocab()
    if len(vocab) > rows or max(vocab.values()) >= rows:
        raise UsageError(f"--format gguf: the tokenizer has {len(vocab):,} tokens, the model {rows:,} embedding rows "
                         "(a preset with a borrowed tokenizer?): its text cannot be written to GGUF")
    if bpe.get("type") != "BPE":
        raise UsageError(f"--format gguf: the tokenizer is a {bpe.get('type')} model; GGUF export writes BPE "
                         "tokenizers (byte-level or SentencePiece-style); export a Hugging Face folder (--format hf)")
    kind = "llama" if bpe.get("byte_fallback") else "gpt2"
    merges = []
    for merge in bpe.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if " " in left or " " in right:
            raise UsageError(f"--format gguf: the tokenizer merges {left!r} and {right!r}, which hold a space GGUF "
                             "merges cannot; export a Hugging Face folder (--format hf)")
        merges.append(f"{left} {right}")

    by_id = {index: token for token, index in vocab.items()}
    added = {index: token.special for index, token in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for index in range(rows):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(5)  # UNUSED
        elif kind == "llama" and index == tokenizer.unk_token_id:
            tokens.append(token)
            types.append(2)  # UNKNOWN
        elif index in added:
            tokens.append(token)
            types.append(3 if added[index] else 4)  # CONTROL (special) or USER_DEFINED
        else:
            tokens.append(token)
            types.append(6 if kind == "llama" and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token) else 1)  # BYTE, NORMAL
    # llama.cpp's SentencePiece tokenizer merges the best-scored pair first; SentencePiece numbers its pieces in
    # the order they were learned, so -id ranks them as their scores did.
    scores = [-float(i) if t == 1 else 0.0 for i, t in enumerate(types)] if kind == "llama" else None
    special_ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")}
    add_bos, add_eos = _adds_special(tokenizer)
    space_prefix = None
    if kind == "llama":
        text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
        space_prefix = '"Prepend"' in text or ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = [{"name": name, "template": text} for name, text in template.items()]
    return Vocabulary(model=kind, pre=_pre_tokenizer_name(spec) if kind == "gpt2" else "default", tokens=tokens,
                      types=types, merges=merges, scores=scores,
                      special_ids={k: v for k, v in special_ids.items() if isinstance(v, int) and 0 <= v < rows},
                      add_bos=add_bos, add_eos=add_eos, add_space_prefix=space_prefix, chat_template=template)


def add_vocabulary(writer, vocab: Vocabulary) -> None:
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for name, index in vocab.special_ids.items():
        getattr(writer, f"add_{name}_token_id")(index)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
    else:
        logger.warning("--format gguf: the tokenizer has no chat template; llama.cpp and Ollama will need one given")


# ---- shape and rotary -----------------------------------------------------------------------------

def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return params


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama3_rope_factors(config) -> torch.Tensor:
    """Per-frequency divisors of Llama 3.1's rotary scaling, as llama.cpp reads them (rope_freqs.weight): the
    plain frequencies over the scaled ones transformers computes."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim, theta = head_dim(config), rope_parameters(config)["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    return (plain / scaled.float()).float()


def check_rope(config) -> str:
    """The rotary scaling type ('default', 'linear', 'yarn', 'llama3'); one line for one llama.cpp cannot take."""
    kind = rope_parameters(config).get("rope_type") or rope_parameters(config).get("type") or "default"
    if kind not in ("default", "linear", "yarn", "llama3"):
        raise UsageError(f"--format gguf: the base scales its rotary embedding by '{kind}', which GGUF export does "
                         "not write (default, linear, yarn, llama3); export a Hugging Face folder (--format hf)")
    return kind


def add_shape(writer, config, arch: str, rows: int, file_type: int, name: str) -> None:
    import gguf

    rope = rope_parameters(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads:  # e.g. Mistral Nemo
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_vocab_size(rows)
    kind = check_rope(config)
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if kind == "yarn" and rope.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    window = getattr(config, "sliding_window", None)
    if window and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)) \
            and window < config.max_position_embeddings:
        logger.warning("--format gguf: the base attends within a sliding window of %d tokens, which llama.cpp's %s "
                       "does not: past that length it computes otherwise", window, arch)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ---- weights --------------------------------------------------------------------------------------

def encode_tensor(data, qtype):
    """(array, GGML type) of a float32 array: 1-D tensors (norms, biases) in F32, as llama.cpp keeps them;
    a matrix whose rows are not whole 32-value blocks in F16 where Q8_0 was asked for."""
    import gguf

    if data.ndim == 1:
        return data, gguf.GGMLQuantizationType.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def add_weights(writer, model, arch: str, qtype) -> dict[str, int]:
    """Every weight of `model` under its llama.cpp name in type `qtype`; returns the count per GGML type.
    Each float32 weight is freed once encoded, so the peak memory stays about the merged model's."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    state = dict(model.state_dict())
    head, embedding = state.get("lm_head.weight"), state["model.embed_tokens.weight"]
    tied = getattr(config, "tie_word_embeddings", False) or head is None or head.data_ptr() == embedding.data_ptr()
    del head, embedding
    if tied:
        state.pop("lm_head.weight", None)  # llama.cpp reads the output layer from token_embd when output is absent
    names = {key: gguf_tensor_name(key) for key in state}  # every name known before anything is encoded
    if check_rope(config) == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config).numpy())
    counts: dict[str, int] = {}
    for key in list(state):
        tensor = state.pop(key).detach().float()
        role = names[key].split(".")[-2]
        if arch == "llama" and role in ("attn_q", "attn_k"):
            tensor = interleave_rotary_rows(tensor, heads if role == "attn_q" else kv_heads)
        data, stored = encode_tensor(tensor.cpu().numpy(), qtype)
        writer.add_tensor(names[key], data, raw_dtype=stored)
        counts[stored.name] = counts.get(stored.name, 0) + 1
        _free(model, key)
    return counts


def _free(model, key: str) -> None:
    module_name, _, attr = key.rpartition(".")
    tensor = getattr(model.get_submodule(module_name), attr, None)
    if isinstance(tensor, torch.Tensor):
        tensor.data = torch.empty(0, dtype=tensor.dtype)


def check_exportable(config, tokenizer) -> None:
    """Everything GGUF export refuses, from the base's config and the tokenizer, as one line: before the base
    loads and before anything is written."""
    gguf_architecture(config)
    check_rope(config)
    vocabulary(tokenizer, config.vocab_size)


def prepared_gguf(model, tokenizer, gguf_type: str, name: str):
    """A GGUF writer holding `model` (a merged transformers causal LM) and `tokenizer`, ready to write, and
    the count of tensors per GGML type. The model's weights are emptied as they are encoded: it is not usable
    afterwards."""
    import gguf

    config = model.config
    arch = gguf_architecture(config)
    rows = model.get_input_embeddings().weight.shape[0]
    vocab = vocabulary(tokenizer, rows)
    qtype_name, file_type = GGUF_TYPES[gguf_type]
    writer = gguf.GGUFWriter(path=None, arch=arch)
    add_shape(writer, config, arch, rows, gguf.LlamaFileType[file_type], name)
    add_vocabulary(writer, vocab)
    counts = add_weights(writer, model, arch, gguf.GGMLQuantizationType[qtype_name])
    if gguf_type == "q8_0" and counts.get("F16"):
        logger.info("%d matrices whose rows are not whole 32-value blocks written in F16, the rest in Q8_0",
                    counts["F16"])
    return writer, counts


def write_file(writer, path: Path) -> None:
    try:
        writer.write_header_to_file(path=Path(path))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
