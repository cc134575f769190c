"""Take a trained policy out: its LoRA adapter merged into a full-precision copy of the base, written as a
standalone Hugging Face model folder that plain `transformers` loads with no project code and no PEFT, or
(`--format gguf`) as one GGUF file for llama.cpp and Ollama, the tokenizer and chat template inside.

    python -m trainer.export --adapter runs/demo/ppo/adapter --out exported/ppo [--dtype bfloat16]
    python -m trainer.export --adapter runs/demo/ppo/adapter --out exported/ppo-gguf --format gguf [--gguf_type q8_0]

The base is rebuilt from the adapter's `base_model.json` and checked against it. An adapter trained on an NF4
base merges by default into the NF4-rounded weights it learned against (`--nf4_rounding`). Reward adapters
are refused, and so is an `--out` that is not an empty folder.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from foundation.cli import Checked, InputError, UsageError, one_of, parse, run
from foundation.files import atomic_folder, check_writable, reported_write_failure
from trainer.engine.setup import base_model_args
from trainer.gguf_export import GGUF_TYPES, MODEL_FILE, check_exportable, prepared_gguf, write_file
from trainer.model.adapter_fit import HEAD_FILE, WEIGHTS_FILE, check_adapter_fits, saved_base
from trainer.model.loading import base_config, load_base_model, load_tokenizer
from trainer.model.shared_base import check_adapter_folder

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportArguments(Checked):
    adapter: str = field(default="", metadata={
        "help": "A saved policy adapter (STAGE_DIR/adapter of sft, ppo, grpo, dpo, or a checkpoint's adapters/policy)."})
    out: str = field(default="", metadata={"help": "The model folder to write (must not exist, or be empty)."})
    format: str = field(default="hf", metadata={
        "help": "hf: a Hugging Face model folder; gguf: a GGUF file for llama.cpp and Ollama (Llama, Mistral, Qwen2)."})
    dtype: Optional[str] = field(default=None, metadata={
        "help": "Weights of an hf export: float32, bfloat16, float16, or auto (the default: the dtype the base "
                "computed in)."})
    gguf_type: Optional[str] = field(default=None, metadata={
        "help": "Weights of a gguf export: f16 (the default), bf16, q8_0 (8-bit, about half f16's size) or f32."})
    nf4_rounding: bool = field(default=True, metadata={
        "help": "For an adapter trained on an NF4 base: export the NF4-rounded base weights it was trained against "
                "(false: the original full-precision weights)."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Allow the base model's own code from the hub (never taken from the adapter's files)."})

    RULES = {"format": one_of("hf", "gguf"), "dtype": one_of("auto", *DTYPES), "gguf_type": one_of(*GGUF_TYPES)}

    def check(self) -> None:
        if not self.adapter or not self.out:
            raise UsageError("usage: python -m trainer.export --adapter DIR --out DIR [--dtype bfloat16 | "
                             "--format gguf [--gguf_type q8_0]]")


def trained_on(adapter: Path) -> dict:
    """How the base computed during training ({quantization, dtype}): as the stage saved it, else (a
    checkpoint's adapter) as the run's settings name it, 'auto' read as full precision in float32."""
    record, source = saved_base(adapter)
    if isinstance(record.get("trained_on"), dict):
        return record["trained_on"]
    quantization, dtype = record.get("quantization", "none"), record.get("dtype", "auto")
    if quantization == "auto":
        logger.warning("%s says quantization auto: exported as trained in full precision (pass the final adapter, "
                       "whose base_model.json says what auto became, to export an NF4-trained one)", source)
    nf4 = quantization == "nf4"
    return {"quantization": "nf4" if nf4 else "none",
            "dtype": dtype if dtype in DTYPES else "bfloat16" if nf4 else "float32"}


def check_finite_weights(adapter: Path) -> None:
    """Every tensor of the adapter's weights file is finite: merged, a NaN or inf would spread into the
    exported base weights, which load and run without a word."""
    from safetensors import SafetensorError, safe_open

    weights = adapter / WEIGHTS_FILE
    if not weights.is_file():
        return
    try:
        with safe_open(str(weights), "pt") as f:
            for key in f.keys():
                if not torch.isfinite(f.get_tensor(key)).all():
                    raise InputError(f"--adapter: {weights} holds NaN or inf values in {key}: the adapter is "
                                     "unusable (its training diverged); export an earlier checkpoint's adapter")
    except (OSError, SafetensorError) as exc:
        raise InputError(f"--adapter: {weights} is not a readable safetensors file ({exc})") from None


def check_inputs(args: ExportArguments) -> tuple[Path, Path]:
    adapter, out = Path(args.adapter), Path(args.out)
    if args.format == "hf" and args.gguf_type is not None:
        raise UsageError(f"--gguf_type {args.gguf_type}: is for --format gguf; a Hugging Face folder takes --dtype")
    if args.format == "gguf" and args.dtype is not None:
        raise UsageError(f"--dtype {args.dtype}: is for --format hf; a GGUF file takes --gguf_type "
                         f"({', '.join(GGUF_TYPES)})")
    check_adapter_folder(adapter, "--adapter")
    if (adapter / HEAD_FILE).is_file():
        raise InputError(f"--adapter {adapter}: a reward adapter (it has {HEAD_FILE}), not a language model; "
                         "export a policy adapter (sft, ppo, grpo or dpo)")
    if out.is_symlink():  # the export is published by renaming onto --out: a link would never be filled
        raise UsageError(f"--out {out}: is a symbolic link; name the folder itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: exists and is not an empty folder; pick a new one")
    check_writable(out, "--out", folder=True)
    return adapter, out


def round_like_nf4_(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace each Linear's weight (but the LM head's, which training kept in full precision) with its
    NF4 double-quantized round trip: the values the 4-bit base computed with. Returns the layers changed."""
    import bitsandbytes.functional as F

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            w = module.weight.data
            q, state = F.quantize_4bit(w.to(compute_dtype), quant_type="nf4", compress_statistics=True)
            module.weight.data = F.dequantize_4bit(q, state).to(w.dtype).reshape(w.shape)
            count += 1
    return count


def export(args: ExportArguments) -> Path:
    from peft import PeftModel

    adapter, out = check_inputs(args)
    model_args = base_model_args(adapter, trust_remote_code=args.trust_remote_code, quantization="none",
                                 dtype="float32", gradient_checkpointing=False)
    trained = trained_on(adapter)
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                               model_args.tokenizer_name_or_path, model_args.trust_remote_code)
    if args.format == "gguf":  # what GGUF export cannot write (an architecture, a tokenizer) before the base loads
        check_exportable(base_config(model_args, len(tokenizer)), tokenizer)
    base = load_base_model(model_args, vocab_size=len(tokenizer), device=torch.device("cpu"))
    check_adapter_fits(adapter, base, model_args.model_name_or_path, "--adapter")
    check_finite_weights(adapter)
    if trained["quantization"] == "nf4" and args.nf4_rounding:
        layers = round_like_nf4_(base, DTYPES.get(trained["dtype"], torch.bfloat16))
        logger.info("base weights of %d layers rounded as NF4 rounded them in training (--nf4_rounding)", layers)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    record = {"adapter": str(adapter), "base": model_args.model_name_or_path, "trained_on": trained,
              "nf4_rounding": args.nf4_rounding}
    if args.format == "gguf":
        return export_gguf(merged, tokenizer, out, args.gguf_type or "f16", record)
    dtype = DTYPES[trained["dtype"] if args.dtype in (None, "auto") else args.dtype]
    merged = merged.to(dtype)
    merged.config.use_cache = True
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            setattr(merged.generation_config, key, value)
    with publishing(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "export.json").write_text(json.dumps({
            **record, "format": "hf", "dtype": str(dtype).removeprefix("torch.")}, indent=2))
    logger.info("exported %s merged into %s (%s) to %s", adapter, model_args.model_name_or_path,
                str(dtype).removeprefix("torch."), out)
    return out


@contextmanager
def publishing(out: Path) -> Iterator[Path]:
    """A temporary folder that becomes --out when the block ends. A disk that fills while writing is one line
    and leaves nothing half-written; an --out that something filled meanwhile is left as it is, and refused."""
    try:
        with atomic_folder(out, into_empty=True) as tmp, reported_write_failure(f"--out {out}", out.parent):
            yield tmp
    except FileExistsError:
        raise UsageError(f"--out {out}: exists and is not an empty folder (it was filled while exporting; "
                         "left as it is); pick a new one") from None


def export_gguf(merged, tokenizer, out: Path, gguf_type: str, record: dict) -> Path:
    """--out as a folder holding the GGUF file, an Ollama Modelfile naming it, and export.json."""
    writer, tensors = prepared_gguf(merged, tokenizer, gguf_type, name=Path(record["base"]).name)
    with publishing(out) as tmp:
        write_file(writer, tmp / MODEL_FILE)
        (tmp / "Modelfile").write_text(f"FROM ./{MODEL_FILE}\n")
        (tmp / "export.json").write_text(json.dumps({
            **record, "format": "gguf", "gguf_type": gguf_type, "tensors": tensors}, indent=2))
    logger.info("exported %s merged into %s to %s (%s)", record["adapter"], record["base"], out / MODEL_FILE,
                gguf_type)
    return out


def main(argv: Optional[list[str]] = None) -> Path:
    (args,) = parse([ExportArguments], list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    path = export(args)
    print(path)
    return path


if __name__ == "__main__":
    run(main)
