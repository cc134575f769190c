"""Rollout decode throughput of the shared base, against the bandwidth bound.

    python -m benchmarks.gpu.decode --model_name_or_path llama-2-7b --quantization nf4 --batches 1,16,64

A decode step reads every weight once whatever the batch, so the bound at batch B is B x bandwidth /
bytes read per step (`profiling.decode`; the bandwidth from a device copy in the same run). Decode time
is generating N tokens less generating one (the prefill). `--paths eager,compiled` times the rollouts'
`--decode` paths (`trainer.model.decode`) on the same rows, each path's first call (compilation) apart from
the best repeat (`compiled_whole`: the compiled step without its decoder-layer regions); `--weights
quantized,dequantized` also times each path decoding from a dense copy of the 4-bit weights
(`--generation_weights`). The bound counts the bytes each weights choice reads.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from benchmarks.kernels import profile_step
from foundation.cli import Checked, UsageError, above, at_least, parse, run
from foundation.files import write_atomic
from foundation.provenance import provenance, relative_command
from foundation.settings import DECODE_PATHS, ModelArguments
from profiling.decode import bytes_per_decode_step, copy_bandwidth, sync
from profiling.report import table_lines
from trainer.engine.launch import resolve_mixed_precision
from trainer.engine.phases import phase
from trainer.model.decode import Generator, Sampling

PROFILE_TOKENS = 8  # tokens of the profiled decode: a prefill and a few steps show where a step's time goes
FIRST_CALL_PHASE_S = 0.5  # compile phases of a first call worth listing

# The compiled path with its step compiled whole (no decoder-layer regions): a comparison, not a --decode choice.
WHOLE = "compiled_whole"


@dataclass
class DecodeArguments(Checked):
    batches: str = field(default="1,16,64", metadata={"help": "Decode batch sizes, comma-separated."})
    prompt_tokens: int = field(default=128, metadata={"help": "Prompt length (random tokens)."})
    new_tokens: int = field(default=64, metadata={"help": "Tokens decoded per row (fixed: min == max)."})
    repeats: int = field(default=2, metadata={"help": "Timed generations per batch size (best kept)."})
    copy_gib: float = field(default=1.0, metadata={"help": "Size of the bandwidth-measuring copy, GiB."})
    paths: str = field(default="eager", metadata={
        "help": "Decode paths to time, comma-separated: eager, compiled (the rollouts' --decode), compiled_whole "
                "(compiled without decoder-layer regions: the step compiled whole)."})
    weights: str = field(default="quantized", metadata={
        "help": "What the base decodes from, comma-separated: quantized, dequantized (--generation_weights)."})
    out_dir: str = field(default="decode", metadata={"help": "Folder for decode.json and decode.md."})
    kernel_profile: Optional[str] = field(default=None, metadata={
        "help": f"After the first row, decode its rows {PROFILE_TOKENS} tokens more under torch.profiler and write "
                "where the time went (benchmarks.kernels) to this folder."})

    RULES = {"prompt_tokens": at_least(1), "new_tokens": at_least(2), "repeats": at_least(1), "copy_gib": above(0),
             "paths": lambda name, value: (None if set(value.split(",")) <= {*DECODE_PATHS, WHOLE}
                                           else f"use some of {', '.join((*DECODE_PATHS, WHOLE))}"),
             "weights": lambda name, value: (None if set(value.split(",")) <= {"quantized", "dequantized"}
                                             else "use some of quantized, dequantized")}


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--batches {text!r}: give batch sizes like 1,16,64")
    return sizes


def rollout_sampling(new_tokens: int) -> Sampling:
    """Exactly `new_tokens` tokens sampled as rollouts sample (temperature 1)."""
    return Sampling(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=1.0)


def row_generator(model, path: str, weights: str) -> Generator:
    """A decoder on `path` from `weights`: a dequantized copy kept (resident), made before the timing; a compiled
    path compiled anew, so that its first call is its own (the whole step, without layer regions, for WHOLE)."""
    generator = Generator(model, "compiled" if path == WHOLE else path,
                          "resident" if weights == "dequantized" else weights)
    if path in ("compiled", WHOLE):
        generator.compile_anew(regions=path == "compiled")
    if weights == "dequantized":
        with run_autocast(next(model.parameters()).device), generator.holding():  # makes the copy, and keeps it
            pass
    return generator


def run_autocast(device: torch.device):
    """The autocast a run's rollouts decode under: its mixed precision as `--mixed_precision auto` resolves
    it (bf16 on CUDA, none on the CPU), so the LoRA products are computed as in training."""
    precision = resolve_mixed_precision("auto")
    if precision == "no":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def compile_seconds() -> dict[str, float]:
    """torch.compile's own timers so far in this process, seconds by phase (dynamo's `compile_times`)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: float(value) for name, value in zip(names, values)}


def time_generation(generator: Generator, ids: torch.Tensor, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(first call's, best later call's) wall time of decoding exactly `new_tokens` tokens for the rows of `ids`,
    sampled as rollouts sample (temperature 1) by `generator`: the first call warms kernels and caches up (and
    compiles, on the compiled path)."""
    mask, sampling = torch.ones_like(ids), rollout_sampling(new_tokens)
    times = []
    for _ in range(repeats + 1):
        sync(ids.device)
        started = time.perf_counter()
        with run_autocast(ids.device):
            generator.sample(ids, mask, sampling, eos_id=0, pad_id=0)
        sync(ids.device)
        times.append(time.perf_counter() - started)
    return times[0], min(times[1:])


def main(argv: Optional[list[str]] = None) -> dict:
    from profiling.shapes import load_shape
    from trainer.model.loading import pick_device
    from trainer.model.shared_base import build_shared_model, stage_specs

    argv = list(sys.argv[1:] if argv is None else argv)
    model_args, args = parse([ModelArguments, DecodeArguments], argv, {"gradient_checkpointing": False})
    device = pick_device()
    vocab = load_shape(model_args.model_name_or_path, overrides=model_args.preset_overrides).vocab_size
    model = build_shared_model(model_args, stage_specs("sft", {}), vocab_size=vocab, device=device).eval()
    bandwidth = copy_bandwidth(device, args.copy_gib)
    read = bytes_per_decode_step(model)
    step_bytes = sum(read.values())
    choices = args.weights.split(",")
    # the bound of each weights choice: a dense copy is read in place of the 4-bit weights
    reads = {w: bytes_per_decode_step(model, weights=w) for w in choices}
    rows, failed = [], []
    planned = len(batch_sizes(args.batches)) * len(args.paths.split(",")) * len(choices)
    result = {**provenance(device, "python -m benchmarks.gpu.decode " + relative_command(argv)),
              "kind": "decode", "model": asdict(model_args), "settings": asdict(args),
              "mixed_precision": resolve_mixed_precision("auto"),
              "copy_bandwidth_bytes_per_s": bandwidth, "bytes_read_per_decode_step": read,
              "bytes_per_decode_step": step_bytes, "bytes_read_per_decode_step_by_weights": reads, "rows": rows,
              "failed": failed,
              "rows_planned": planned}
    out = Path(args.out_dir)
    generator = torch.Generator().manual_seed(0)
    for batch in batch_sizes(args.batches):
        ids = torch.randint(3, vocab, (batch, args.prompt_tokens), generator=generator).to(device)
        mask = torch.ones_like(ids)
        for path, weights in [(p, w) for w in choices for p in args.paths.split(",")]:
            bound = batch * bandwidth / sum(reads[weights].values())
            generator = row_generator(model, path, weights)
            compiled_before = compile_seconds()
            try:
                first, full = time_generation(generator, ids, args.new_tokens, args.repeats)
                spent = {name: s - compiled_before.get(name, 0.0) for name, s in compile_seconds().items()}
                _, prefill = time_generation(generator, ids, 1, args.repeats)
                error = None if full > prefill else (  # noise larger than the decoding: no made-up figure
                    f"not timed: generating {args.new_tokens} tokens ({full:.4f} s) took no longer than the "
                    f"prefill ({prefill:.4f} s); decode more tokens")
            except Exception as exc:  # one that fails here (a kernel, a compilation) leaves the others their rows
                error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            if error is not None:
                failed.append({"path": path, "weights": weights, "batch": batch, "error": error})
                print(f"{path}, {weights}, batch {batch}: failed: {error}", flush=True)
                write_result(result, out)
                generator.release()
                continue
            first_call_compile = {name: round(s, 2) for name, s in spent.items() if s >= FIRST_CALL_PHASE_S}
            decode_s = full - prefill
            tokens_per_s = batch * (args.new_tokens - 1) / decode_s
            rows.append({"path": path, "weights": weights, "batch": batch, "decode_s": decode_s, "generate_s": full,
                         "first_call_s": first, "first_call_compile_s": first_call_compile, "prefill_s": prefill,
                         "tokens_per_s": tokens_per_s,
                         "bound_tokens_per_s": bound, "bandwidth_fraction": tokens_per_s / bound,
                         "ms_per_step": 1e3 * decode_s / (args.new_tokens - 1)})
            print(f"{path}, {weights}, batch {batch}: {tokens_per_s:.1f} tokens/s, {rows[-1]['ms_per_step']:.1f} ms "
                  f"per step, {rows[-1]['bandwidth_fraction']:.1%} of the bandwidth bound ({bound:.0f} tokens/s); "
                  f"first call {first:.2f} s", flush=True)
            write_result(result, out)  # after every row: a run stopped part-way keeps the rows it finished
            if args.kernel_profile and len(rows) == 1:  # the first row, warm: where a decode step's time goes
                sampling = rollout_sampling(PROFILE_TOKENS)

                def generate():
                    with phase("generate"), run_autocast(device):
                        generator.sample(ids, mask, sampling, eos_id=0, pad_id=0)

                profile_step(generate, device, Path(args.kernel_profile),
                             f"decode, {path} from {weights} weights, {batch} rows x {PROFILE_TOKENS} tokens",
                             phases=("generate",))
            generator.release()
    write_result(result, out)
    return result


def write_result(result: dict, out: Path) -> None:
    write_atomic(out / "decode.json", json.dumps(result, indent=2))
    write_atomic(out / "decode.md", markdown(result))


def markdown(result: dict) -> str:
    lines = [f"# Decode throughput: {result['model']['model_name_or_path']} ({result['model']['quantization']})", "",
             f"- device: {result['device_name']}; date {result['date']}; git `{result['git_revision']}`",
             f"- command: `{result['command']}`",
             f"- device copy bandwidth: {result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read + write); "
             f"decoded under the mixed precision a run uses: {result.get('mixed_precision', 'no')}",
             *([f"- rows: {len(result['rows'])} of {result['rows_planned']}: the run stopped before the rest"]
               if len(result["rows"]) + len(result.get("failed", [])) < result.get("rows_planned", 0) else []),
             *(f"- {f['path']} from {f['weights']} weights at {f['batch']} rows failed: `{f['error']}`"
               for f in result.get("failed", [])),
             *(f"- bytes read per decode step from {weights} weights: {sum(read.values()) / 2**30:.3f} GiB "
               f"({', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in read.items())})"
               for weights, read in result.get("bytes_read_per_decode_step_by_weights",
                                               {"quantized": result["bytes_read_per_decode_step"]}).items()), "",
             *table_lines(["path", "weights", "batch", "decoded tokens/s", "ms per step", "whole generation s (best)",
                           "first call s", "bound tokens/s", "fraction of bound"], "ll" + "r" * 7, [
                 [r["path"], r.get("weights", "quantized"), r["batch"], f"{r['tokens_per_s']:.1f}",
                  f"{r['ms_per_step']:.2f}", f"{r['generate_s']:.3f}", f"{r['first_call_s']:.2f}",
                  f"{r['bound_tokens_per_s']:.0f}", f"{r['bandwidth_fraction']:.1%}"] for r in result["rows"]])]
    timed = [r for r in result["rows"] if r.get("first_call_compile_s")]
    if timed:
        lines.append("")
    for r in timed:
        phases = sorted(r["first_call_compile_s"].items(), key=lambda item: -item[1])
        lines.append(f"- first call, {r['path']} from {r.get('weights', 'quantized')} weights at {r['batch']} rows, "
                     f"torch.compile's own timers (s; phases nest; "
                     f"{FIRST_CALL_PHASE_S} s or more): " + ", ".join(f"`{k}` {v:.2f}" for k, v in phases))
    lines += ["", "Paths (the rollouts' --decode, trainer/model/decode.py): eager (a KV cache grown per step: the "
              "default), compiled (a full-length KV cache and a torch.compile'd step, CUDA graphs on CUDA, its decoder "
              "layers compiled once as one reused region), compiled_whole (the same step compiled whole). Weights "
              "(--generation_weights): quantized (the 4-bit weights), dequantized (a dense copy made before the "
              "timing). First call: compilation and warm-up, left out of the other columns."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run(main)
