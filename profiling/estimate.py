"""Predict device memory per component and phase for a stage, before running it.

    python -m profiling.estimate --model llama-2-7b --stage ppo [--micro-batch 4 ...] [--compare-seed]

Resident components (base weights, NF4 constants, adapters, heads, gradients, optimizer states)
are exact closed forms (`profiling.shapes`, `profiling.optimizers`); activations, logits and the KV
cache follow the formulas in `profiling.activations`. Allocator overhead and the CUDA context are
assumptions (flags) until a GPU run replaces them. The output uses the recorder's JSON layout, so
`python -m profiling.report` renders an estimate the same way as a measured run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from profiling import activations as A
from profiling import components as C
from profiling.optimizers import OPTIMIZERS, gradient_bytes, optimizer_bytes, step_temporaries
from profiling.shapes import (DTYPE_BYTES, ModelShape, base_bytes, head_tensor_sizes, load_shape,
                              lora_tensor_sizes)

STAGES = ("sft", "reward", "ppo", "dpo")
# (adapter, trainable, has a head) per stage: what `build_shared_model` is given.
STAGE_ADAPTERS = {
    "sft": [("policy", True, False)],
    "reward": [("reward", True, True)],
    "ppo": [("policy", True, False), ("reference", False, False), ("value", True, True), ("reward", False, True)],
    "dpo": [("policy", True, False), ("reference", False, False)],
}


@dataclass
class EstimateArguments:
    """Model, stage and run settings to estimate; defaults are the trainer's QLoRA defaults."""

    model: Optional[str] = field(default=None, metadata={"help": "Preset (tiny-llama, llama-2-7b, llama-2-13b), "
                                 "'smollm2-135m', or an HF folder with config.json; or give the shape flags."})
    stage: str = field(default="ppo", metadata={"help": "sft, reward, ppo or dpo."})
    hidden_size: Optional[int] = field(default=None, metadata={"help": "Shape override (all shape flags too)."})
    intermediate_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    preset_overrides: Optional[str] = field(default=None, metadata={"help": "As in ModelArguments."})
    quantization: str = field(default="nf4", metadata={"help": "nf4 (double quant) or none."})
    dtype: str = field(default="bfloat16", metadata={"help": "Compute dtype: bfloat16, float16 or float32."})
    lora_r: int = 16
    lora_target_modules: str = field(default="all-linear", metadata={"help": "'all-linear' or q_proj,v_proj,..."})
    lora_dropout: float = 0.05
    optimizer: str = field(default="paged_adamw_8bit", metadata={"help": ", ".join(OPTIMIZERS)})
    gradient_checkpointing: bool = True
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, flash_attention_2 or eager."})
    micro_batch: int = field(default=4, metadata={"help": "Sequences (sft) or pairs (reward, dpo) per micro-batch."})
    max_length: int = field(default=512, metadata={"help": "Sequence length for sft, reward and dpo."})
    prompt_length: int = field(default=256, metadata={"help": "PPO prompt tokens."})
    generation_length: int = field(default=128, metadata={"help": "PPO generated tokens."})
    rollout_batch: int = field(default=64, metadata={"help": "PPO prompts per rollout (sizes the rollout buffers)."})
    generation_batch: Optional[int] = field(default=None, metadata={"help": "PPO rows per generate / scoring pass "
                                            "(default: the micro-batch, as trainer.rollout.make_rollout chunks)."})
    logprob_chunk: int = field(default=1024, metadata={"help": "Positions per fp32 log-prob chunk."})
    device: str = field(default="cuda", metadata={"help": "cuda, or cpu (fp32 dropout masks, step counters on device)."})
    budget_gib: float = field(default=24.0, metadata={"help": "Device budget in GiB (2^30 bytes)."})
    cuda_context_gib: float = field(default=0.5, metadata={"help": "Assumed memory outside the allocator."})
    allocator_overhead: float = field(default=0.05, metadata={"help": "Assumed reserved-minus-allocated, as a "
                                      "fraction of allocated."})
    compare_seed: bool = field(default=False, metadata={"help": "Compare with seed 000's 7B/4090 breakdown."})
    json: Optional[str] = field(default=None, metadata={"help": "Write the estimate as JSON to this file."})
    out_dir: Optional[str] = field(default=None, metadata={"help": "Write estimate.json/.md/.png here."})

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_gib * C.GIB)


def resolve_shape(args: EstimateArguments) -> ModelShape:
    """The model's shape from --model, with any explicit shape flag overriding it."""
    flags = {k: getattr(args, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                           "num_kv_heads", "head_dim", "vocab_size", "tie_word_embeddings")}
    if args.model is None:
        missing = [k for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "vocab_size")
                   if flags[k] is None]
        if missing:
            raise SystemExit(f"without --model, give the shape: missing --{', --'.join(m.replace('_', '-') for m in missing)}")
        heads = flags["num_heads"]
        return ModelShape(name="custom", hidden_size=flags["hidden_size"], intermediate_size=flags["intermediate_size"],
                          num_layers=flags["num_layers"], num_heads=heads, num_kv_heads=flags["num_kv_heads"] or heads,
                          vocab_size=flags["vocab_size"], head_dim=flags["head_dim"] or flags["hidden_size"] // heads,
                          tie_word_embeddings=bool(flags["tie_word_embeddings"]))
    shape = load_shape(args.model, args.vocab_size, args.preset_overrides)
    return replace(shape, **{k: v for k, v in flags.items() if v is not None})


def _validate(args: EstimateArguments) -> None:
    if args.stage not in STAGES:
        raise SystemExit(f"unknown stage '{args.stage}': use one of {', '.join(STAGES)}")
    if args.quantization not in ("nf4", "none"):
        raise SystemExit(f"unknown quantization '{args.quantization}': use nf4 or none")
    if args.dtype not in DTYPE_BYTES:
        raise SystemExit(f"unknown dtype '{args.dtype}': use bfloat16, float16 or float32")
    if args.device not in ("cuda", "cpu"):
        raise SystemExit(f"unknown device '{args.device}': use cuda or cpu")


# ---------------------------------------------------------------- resident components


def resident(shape: ModelShape, args: EstimateArguments) -> dict:
    """Components that live through the whole stage, and the trainable tensor sizes behind them."""
    a = 2 if args.quantization == "nf4" and DTYPE_BYTES[args.dtype] == 4 else DTYPE_BYTES[args.dtype]
    parts = base_bytes(shape, args.quantization, a)
    lora = lora_tensor_sizes(shape, args.lora_r, args.lora_target_modules)
    trainable: list[int] = []
    for name, train, has_head in STAGE_ADAPTERS[args.stage]:
        parts[C.adapter(name)] = 4 * sum(lora)
        if has_head:
            parts[C.head(name)] = 4 * sum(head_tensor_sizes(shape))
        if train:
            trainable += lora + (head_tensor_sizes(shape) if has_head else [])
    opt = optimizer_bytes(trainable, args.optimizer, args.device)
    parts[C.OPTIMIZER_STATES] = opt.device
    return {"components": parts, "trainable": trainable, "optimizer": opt, "dtype_bytes": a}


def forward_spec(args: EstimateArguments, dtype_bytes: int) -> A.ForwardSpec:
    return A.ForwardSpec(dtype_bytes=dtype_bytes, lora_rank=args.lora_r, lora_targets=args.lora_target_modules,
                         lora_dropout=args.lora_dropout > 0, device=args.device, attention=args.attn_implementation,
                         checkpointing=args.gradient_checkpointing, logprob_chunk=args.logprob_chunk,
                         nf4=args.quantization == "nf4")


def rollout_buffer_bytes(args: EstimateArguments) -> int:
    """Token ids and attention mask (int64) of the rollout, and six fp32 per-token series over the
    response: log-probs, reference log-probs, values, rewards, advantages, returns."""
    batch, context = args.rollout_batch, args.prompt_length + args.generation_length
    return batch * context * 8 * 2 + 6 * batch * args.generation_length * 4


# ---------------------------------------------------------------- phases


def _transient_phases(shape: ModelShape, args: EstimateArguments, spec: A.ForwardSpec, trainable: list[int]) -> list:
    """(phase, {component: bytes}) for what each phase adds on top of the resident components."""
    grads = {C.GRADIENTS: gradient_bytes(trainable)}
    step = ("optimizer_step", {**grads, C.OPTIMIZER_TEMPORARIES: step_temporaries(trainable, args.optimizer)})
    mb, seq = args.micro_batch, args.max_length
    # SFT and DPO build logits at completion positions only (`output="logprobs"`); how many there are
    # depends on the data, so the logits are sized for the worst case, every position a completion.
    if args.stage == "sft":
        tokens = mb * seq
        return [("forward_backward", {**grads, C.ACTIVATIONS: A.training_activations(shape, spec, tokens, seq),
                                      C.LOGITS: A.logits_training(shape, spec, tokens)}), step]
    if args.stage == "reward":  # chosen and rejected of each pair; scores read hidden states, no logits
        tokens = 2 * mb * seq
        return [("forward_backward", {**grads, C.ACTIVATIONS: A.training_activations(shape, spec, tokens, seq)}), step]
    if args.stage == "dpo":
        tokens = 2 * mb * seq
        return [("reference", {C.ACTIVATIONS: A.nograd_activations(shape, spec, tokens, seq),
                               C.LOGITS: A.logits_nograd(shape, spec, tokens)}),
                ("forward_backward", {**grads, C.ACTIVATIONS: A.training_activations(shape, spec, tokens, seq),
                                      C.LOGITS: A.logits_training(shape, spec, tokens)}), step]
    # PPO as trainer.rollout / trainer.ppo_step run it: generation and scoring in chunks of
    # `generation_batch` rows; logits only for the response positions (keep_last = generation + 1).
    context = args.prompt_length + args.generation_length
    rows = generation_batch(args)
    buffers = {C.ROLLOUT_BUFFERS: rollout_buffer_bytes(args)}
    scored = rows * (args.generation_length + 1)
    return [
        ("generate", {**buffers, C.KV_CACHE: A.kv_cache(shape, spec, rows, context)
                      + A.kv_cache_growth(shape, spec, rows, context),
                      C.ACTIVATIONS: A.nograd_activations(shape, spec, rows * args.prompt_length, args.prompt_length)}),
        # policy log-probs and entropy, and the reward model's scores
        ("score", {**buffers, C.ACTIVATIONS: A.nograd_activations(shape, spec, rows * context, context),
                   C.LOGITS: A.logits_nograd(shape, spec, scored)}),
        ("reference", {**buffers, C.ACTIVATIONS: A.nograd_activations(shape, spec, rows * context, context),
                       C.LOGITS: A.logits_nograd(shape, spec, scored)}),
        ("value", {**buffers, C.ACTIVATIONS: A.nograd_activations(shape, spec, rows * context, context)}),
        # Policy and value forwards of a micro-batch are alive together (one backward of the summed loss).
        ("update", {**buffers, **grads,
                    C.ACTIVATIONS: A.training_activations(shape, spec, mb * context, context, forwards=2),
                    C.LOGITS: A.logits_training(shape, spec, mb * (args.generation_length + 1))}),
        step,
    ]


def generation_batch(args: EstimateArguments) -> int:
    return args.generation_batch or args.micro_batch


def estimate(shape: ModelShape, args: EstimateArguments) -> dict:
    """The estimate in the recorder's JSON layout: one entry per phase, components in bytes."""
    _validate(args)
    res = resident(shape, args)
    spec = forward_spec(args, res["dtype_bytes"])
    phases = []
    for name, extra in _transient_phases(shape, args, spec, res["trainable"]):
        comps = {**res["components"], **extra}
        allocated = C.total(comps)
        comps[C.ALLOCATOR_OVERHEAD] = int(args.allocator_overhead * allocated)
        comps[C.CUDA_CONTEXT] = int(args.cuda_context_gib * C.GIB) if args.device == "cuda" else 0
        comps = {k: comps[k] for k in C.ordered(comps)}
        phase = {"stage": args.stage, "phase": name, "components": comps, "total": C.total(comps),
                 "peak_allocated": allocated}
        if res["optimizer"].host:
            phase["elsewhere"] = {"cpu": {C.OPTIMIZER_STATES: res["optimizer"].host}}
        if res["optimizer"].paged:
            phase["paged"] = {C.OPTIMIZER_STATES: res["optimizer"].paged}
        phases.append(phase)
    peak = max(phases, key=lambda p: p["total"])
    return {
        "title": f"estimate: {shape.name} {args.stage}",
        "kind": "estimate",
        "unit": "bytes",
        "budget_bytes": args.budget_bytes,
        "config": {"shape": shape.to_dict(), "settings": asdict(args),
                   "trainable_parameters": sum(res["trainable"])},
        "phases": phases,
        "peak_phase": peak["phase"],
        "peak_bytes": peak["total"],
        "fits": peak["total"] <= args.budget_bytes,
        "notes": assumptions(args),
    }


def assumptions(args: EstimateArguments) -> list[str]:
    notes = [
        "activations: formulas in profiling/activations.py (saved tensors per layer read off autograd); "
        + ("checkpointing keeps each layer's input and recomputes one layer in backward"
           if args.gradient_checkpointing else "no checkpointing: every layer's saved tensors live until backward"),
        "logits: (tokens x vocab) in the compute dtype plus fp32 chunks of "
        f"{args.logprob_chunk} positions (trainer.losses.token_logprobs); in training also their gradient",
        f"allocator_overhead and cuda_context are assumptions ({args.allocator_overhead:.0%} of allocated, "
        f"{args.cuda_context_gib} GiB) until a GPU run measures them",
        "optimizer_states are the steady state after the first step; gradients are fp32 LoRA/head gradients",
    ]
    if args.stage == "ppo":
        notes.append("ppo update: policy and value forwards alive together; the optimizer step of ppo is "
                     "listed as its own phase")
    if args.optimizer == "paged_adamw_8bit":
        notes.append("paged 8-bit states are CUDA managed memory: same bytes, but they can spill to host RAM "
                     "and torch.cuda.memory_allocated does not count them")
    return notes


# ---------------------------------------------------------------- command line


def table(est: dict) -> str:
    from profiling.report import markdown_table

    return markdown_table(est)


def main(argv: Optional[list[str]] = None) -> int:
    from transformers import HfArgumentParser

    from profiling.advice import advice_lines
    from profiling.provenance import provenance

    (args,) = HfArgumentParser(EstimateArguments).parse_args_into_dataclasses(
        args=list(sys.argv[1:] if argv is None else argv))
    shape = resolve_shape(args)
    est = estimate(shape, args)
    est.update({k: v for k, v in provenance(command="python -m profiling.estimate " + " ".join(
        sys.argv[1:] if argv is None else argv)).items() if k not in est})
    est["device"], est["device_name"] = "estimate", f"estimate for {args.device}"
    print(f"{shape.name} ({shape.total_params() / 1e9:.2f}B parameters), stage {args.stage}, "
          f"{args.quantization}, {args.optimizer}, checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
          f"{est['config']['trainable_parameters']:,} trainable parameters")
    print(table(est))
    print(f"peak: {C.gib(est['peak_bytes'])} GiB in phase '{est['peak_phase']}' against a budget of "
          f"{C.gib(args.budget_bytes)} GiB: {'fits' if est['fits'] else 'DOES NOT FIT'}")
    lines, suggestions = advice_lines(shape, args, est)
    est["suggestions"] = suggestions
    print("\n".join(lines))
    if args.compare_seed:
        from profiling.seed import compare_seed

        text, rows = compare_seed(shape, args, est)
        est["seed_comparison"] = rows
        print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(est, indent=2) + "\n")
    if args.out_dir:
        from profiling.report import write_reports

        for kind, path in write_reports(est, args.out_dir, json_name="estimate.json").items():
            print(f"wrote {kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
