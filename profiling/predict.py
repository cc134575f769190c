"""Predict device memory per component and phase for a stage, before running it.

Resident components are exact closed forms (`profiling.shapes`, `profiling.optimizers`); activations, logits
and KV cache follow `profiling.activations`; allocator overhead and the CUDA context are flags. The output
uses the recorder's JSON layout, so `python -m profiling.report` renders it like a measured run. The settings
are the run's own (`EstimateArguments` derives from its argument classes): a stage hands over its arguments
as they are (`EstimateArguments.of_run`), and a stage's config file reads the same (`profiling.estimate --config`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional

from foundation.cli import UsageError, at_least, one_of, unplanned
from foundation.settings import (
    ONLINE_RL_STAGES, DataArguments, GRPOArguments, ModelArguments, PPOArguments, RolloutArguments, TrainArguments,
    training_lora_dropout,
)
from foundation.stages import REFERENCE, REWARD, STAGES, Slot, stage_adapters
from profiling import activations as A
from profiling import components as C
from profiling import resolve
from profiling.optimizers import OPTIMIZERS, gradient_bytes, optimizer_bytes, step_temporaries
from profiling.shapes import DTYPE_BYTES, ModelShape, base_bytes, head_tensor_sizes, load_shape, lora_tensor_sizes


def _card_sizes(value: Optional[str]) -> list[float]:
    """A --cards value (sizes in GiB, comma-separated) as sizes, smallest first; ValueError where one is no number."""
    return sorted(float(size) for size in (value or "").split(",") if size.strip())


def _card_sizes_problem(value: Optional[str]) -> Optional[str]:
    """What is wrong with a --cards value, or None."""
    if value is None:
        return None
    try:
        sizes = _card_sizes(value)
    except ValueError:
        return "must be card sizes in GiB, comma-separated, e.g. 8,12,16,24"
    return None if sizes and all(size > 0 for size in sizes) else "must name at least one size, each above 0"


@dataclass(frozen=True)
class EstimateArguments(ModelArguments, DataArguments, TrainArguments, PPOArguments, GRPOArguments):
    """A run's own settings - every field of its model, data, training and online-RL sections, with the run's
    defaults (`foundation.settings`) - plus what only an estimate needs: the stage, the device, shape
    overrides, and what the estimate assumes beside the allocator's own figures."""

    stage: str = field(default="ppo", metadata={"help": "sft, reward, ppo, dpo or grpo."})
    reward_model: bool = field(default=True, metadata={
        "help": "PPO, GRPO: scored by the reward adapter and head; false: by reward functions (--scripted_reward), "
                "no reward adapter, head or pass."})
    hidden_size: Optional[int] = field(default=None, metadata={"help": "Shape override (all shape flags too)."})
    intermediate_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    device: str = field(default="cuda", metadata={"help": "cuda, or cpu (fp32 dropout masks, step counters on device)."})
    cuda_context_gib: float = field(default=0.5, metadata={
        "help": "Memory outside the allocator at a run's start (CUDA's context, cuBLAS): a run on CUDA measures it; "
                "assumed here."})
    cuda_kernels_gib: float = field(default=0.9, metadata={
        "help": "Memory outside the allocator that CUDA adds after the start, loading each kernel's code the first "
                "time the run calls it (lazy module loading): assumed."})
    allocator_overhead: float = field(default=0.05, metadata={"help": "Assumed reserved-minus-allocated, as a "
                                      "fraction of allocated."})
    models: Optional[str] = field(default=None, metadata={
        "help": "Several models, comma-separated: one summary row each (parameters, base weights, peak per phase) "
                "instead of one model's full table."})
    cards: Optional[str] = field(default=None, metadata={
        "help": "Card sizes in GiB, comma-separated (e.g. 8,12,16,24): which of them hold the run, each as its "
                "memory_budget_gib with the plan a PPO / GRPO run makes for it, and the smallest that does, instead "
                "of one budget's table."})
    json: Optional[str] = field(default=None, metadata={"help": "Write the estimate as JSON to this file."})
    out_dir: Optional[str] = field(default=None, metadata={"help": "Write estimate.json/.md/.png here."})

    SECTION = "estimate"
    PLANNED = (*ModelArguments.PLANNED, *TrainArguments.PLANNED, *PPOArguments.PLANNED)
    # the run's rules; the optimizer may also be DeepSpeed's offloaded one, which only the launch says
    RULES = {**ModelArguments.RULES, **DataArguments.RULES, **TrainArguments.RULES, **PPOArguments.RULES,
             **GRPOArguments.RULES, "optimizer": one_of("auto", *OPTIMIZERS), "stage": one_of(*STAGES),
             "device": one_of("cuda", "cpu"), "cuda_context_gib": at_least(0), "cuda_kernels_gib": at_least(0),
             "allocator_overhead": at_least(0), "cards": lambda name, value: _card_sizes_problem(value),
             "vocab_size": at_least(1), "hidden_size": at_least(1), "intermediate_size": at_least(1),
             "num_layers": at_least(1), "num_heads": at_least(1), "num_kv_heads": at_least(1), "head_dim": at_least(1)}

    def check(self) -> None:
        """The run's checks between fields; GRPO's own only for a GRPO estimate."""
        DataArguments.check(self)
        (GRPOArguments if self.stage == "grpo" else RolloutArguments).check(self)

    def card_sizes(self) -> list[float]:
        """`cards` as sizes in GiB, smallest first."""
        return _card_sizes(self.cards)

    @property
    def budget_bytes(self) -> int:
        return int(self.memory_budget_gib * C.GIB)

    @classmethod
    def of_run(cls, *settings: Any, **given: Any) -> "EstimateArguments":
        """The estimate of a run from its own argument objects: each field is read, by name, from the
        first object that has it (ModelArguments, DataArguments, TrainArguments, the stage's). An online RL
        run holds a reward model when it names a reward adapter (the stages load it even beside a scripted
        reward, as the value adapter's start), so `reward_model` is read off `reward_adapter`."""
        values = {}
        for f in fields(cls):
            for obj in settings:
                if hasattr(obj, f.name):
                    values[f.name] = getattr(obj, f.name)
                    break
        scorer = next((obj for obj in settings if hasattr(obj, "reward_adapter")), None)
        if scorer is not None and "reward_model" not in values:
            values["reward_model"] = scorer.reward_adapter is not None
        return cls(**{**values, **given})

    def resolved(self) -> "EstimateArguments":
        """The settings with 'auto' turned into what it means on `device` (profiling.resolve's rule); a planned
        setting still auto at its value where nothing plans it (`foundation.cli.unplanned`)."""
        args = unplanned(self)
        nf4 = resolve.four_bit(args.quantization, args.device)
        weights = args.generation_weights if nf4 and args.stage in ONLINE_RL_STAGES else "quantized"
        return replace(args, quantization="nf4" if nf4 else "none",
                       lora_dropout=training_lora_dropout(args.stage, args.lora_dropout),
                       generation_weights="quantized" if weights == "auto" else weights,
                       decode=resolve.decode_path(args.decode, args.device, args.offload_embeddings),
                       dtype=resolve.compute_dtype(args.dtype, args.device, nf4),
                       optimizer=args.optimizer if args.optimizer == "deepspeed_zero2_offload"
                       else resolve.optimizer(args.optimizer, args.device),
                       mixed_precision=args.autocast_dtype)

    @property
    def autocast_dtype(self) -> str:
        """--mixed_precision as the trainer resolves it (trainer.engine.launch): auto is bf16 on cuda, no on cpu."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        return "bf16" if self.device == "cuda" else "no"


def adapters(args: EstimateArguments) -> list[Slot]:
    """The adapters a run of the stage puts on the base, as trainer/ppo.py and trainer/grpo.py build them: no
    reward adapter when reward functions score (PPO, GRPO), no reference when GRPO's beta is 0."""
    online = args.stage in ONLINE_RL_STAGES
    without = ((REWARD,) if online and not args.reward_model else ()) + (
        (REFERENCE,) if args.stage == "grpo" and args.beta == 0 else ())
    return stage_adapters(args.stage, without)


def roles(args: EstimateArguments) -> list[str]:
    return [slot.role for slot in adapters(args)]


def resolve_shape(args: EstimateArguments) -> ModelShape:
    """The model's shape from --model_name_or_path, with any explicit shape flag overriding it."""
    flags = {k: getattr(args, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                           "num_kv_heads", "head_dim", "vocab_size", "tie_word_embeddings")}
    core = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "vocab_size")
    if args.model_name_or_path is None or all(flags[k] is not None for k in core):  # the shape itself, no model
        missing = [k for k in core if flags[k] is None]
        if missing:
            raise UsageError(f"without --model, give the shape: missing --{', --'.join(missing)}")
        heads = flags["num_heads"]
        return ModelShape(name="custom", hidden_size=flags["hidden_size"], intermediate_size=flags["intermediate_size"],
                          num_layers=flags["num_layers"], num_heads=heads, num_kv_heads=flags["num_kv_heads"] or heads,
                          vocab_size=flags["vocab_size"], head_dim=flags["head_dim"] or flags["hidden_size"] // heads,
                          tie_word_embeddings=bool(flags["tie_word_embeddings"]))
    shape = load_shape(args.model_name_or_path, args.vocab_size, args.preset_overrides)
    return replace(shape, **{k: v for k, v in flags.items() if v is not None})


# ---------------------------------------------------------------- resident components


def resident(shape: ModelShape, args: EstimateArguments) -> dict:
    """Components that live through the whole stage, and the trainable tensor sizes behind them."""
    a = 2 if args.quantization == "nf4" and DTYPE_BYTES[args.dtype] == 4 else DTYPE_BYTES[args.dtype]
    parts = base_bytes(shape, args.quantization, a)
    if offloaded_embedding(shape, args):
        parts[C.BASE_OTHER] -= shape.vocab_size * shape.hidden_size * a
    lora = lora_tensor_sizes(shape, args.lora_r, args.lora_target_modules)
    trainable: list[int] = []
    for slot in adapters(args):
        parts[C.adapter(slot.role)] = 4 * sum(lora)
        if slot.head:
            parts[C.head(slot.role)] = 4 * sum(head_tensor_sizes(shape))
        if slot.trainable:
            trainable += lora + (head_tensor_sizes(shape) if slot.head else [])
    if args.generation_weights == "resident":
        parts[C.GENERATION_WEIGHTS] = generation_weight_bytes(shape, a, args)
    lora_copies = decode_lora_bytes(shape, args)
    if args.decode == "compiled" and lora_copies:  # kept for the compiled step's graphs
        parts[C.GENERATION_WEIGHTS] = parts.get(C.GENERATION_WEIGHTS, 0) + lora_copies
    if args.decode == "compiled" and args.stage in ONLINE_RL_STAGES:
        parts[C.KV_CACHE] = A.compiled_kv_cache(shape, forward_spec(args, a), args.rollout_micro_batch_size,
                                                args.max_prompt_length + args.max_new_tokens)
    opt = optimizer_bytes(trainable, args.optimizer, args.device)
    parts[C.OPTIMIZER_STATES] = opt.device
    return {"components": parts, "trainable": trainable, "optimizer": opt, "dtype_bytes": a}


def _decodes_under_autocast(args: EstimateArguments) -> bool:
    """Whether the run's rollouts decode under mixed precision
    (trainer.model.decode_weights.DecodeWeights.lora_copies)."""
    return args.stage in ONLINE_RL_STAGES and args.autocast_dtype in ("bf16", "fp16")


def decode_lora_bytes(shape: ModelShape, args: EstimateArguments) -> int:
    """The policy's LoRA weights copied into the autocast dtype for a rollout's decoding
    (trainer.model.decode_weights.DecodeWeights.lora_copies): lora_B, and lora_A unless a dense copy of the base holds
    it (`generation_weight_bytes`); none without mixed precision."""
    if not _decodes_under_autocast(args):
        return 0
    sizes = lora_tensor_sizes(shape, args.lora_r, args.lora_target_modules)
    return 2 * sum(sizes[1::2] if args.generation_weights in ("resident", "dequantized") else sizes)


def generation_weight_bytes(shape: ModelShape, dtype_bytes: int, args: Optional[EstimateArguments] = None) -> int:
    """The dense copy of every 4-bit linear layer in the compute dtype
    (trainer.model.decode_weights.DecodeWeights.dense); with `args` of a run that decodes under mixed precision,
    also the rows under each LoRA target's matrix that hold the policy's LoRA-A weights
    (trainer.model.decode_weights.DequantizedLinear)."""
    rows = 0 if args is None or not _decodes_under_autocast(args) else \
        sum(lora_tensor_sizes(shape, args.lora_r, args.lora_target_modules)[::2])
    return (shape.linear_params() + rows) * dtype_bytes


def offloaded_embedding(shape: ModelShape, args: EstimateArguments) -> bool:
    """Whether the run keeps its input embedding in host memory (trainer.model.loading.HostEmbedding)."""
    return args.offload_embeddings and args.device == "cuda" and not shape.tie_word_embeddings


def forward_spec(args: EstimateArguments, dtype_bytes: int) -> A.ForwardSpec:
    return A.ForwardSpec(dtype_bytes=dtype_bytes, lora_rank=args.lora_r, lora_targets=args.lora_target_modules,
                         lora_dropout=args.lora_dropout > 0, device=args.device, attention=args.attn_implementation,
                         checkpointing=args.gradient_checkpointing, nf4=args.quantization == "nf4",
                         autocast=args.autocast_dtype != "no",
                         offload=args.offload_activations and args.device == "cuda")


def rollout_buffer_bytes(args: EstimateArguments) -> int:
    """Token ids and attention mask (int64) of the rollout, and six fp32 per-token series over the
    response: log-probs, reference log-probs, values, rewards, advantages, returns."""
    batch, context = args.rollout_batch_size, args.max_prompt_length + args.max_new_tokens
    return batch * context * 8 * 2 + 6 * batch * args.max_new_tokens * 4


# ---------------------------------------------------------------- phases


def _training(shape: ModelShape, spec: A.ForwardSpec, tokens: int, seq: int, positions: int, held: dict,
              adapters: int = 1, extra: int = 0) -> tuple[dict, list[dict], int]:
    """(held, moments, host) of a training pass: the LM head's backward at `positions` (none: a scalar head)
    runs beside the kept activations alone, then each layer's backward (A.training_parts). `extra`:
    activation bytes alive throughout (a pair mask)."""
    kept, layer, host = A.training_parts(shape, spec, tokens, seq, adapters)
    head = {C.LOGITS: A.head_logprobs_training(shape, spec, positions) if positions else 0,
            C.ACTIVATIONS: A.head_inputs(shape, spec, tokens, positions)}
    return _merged(held, {C.ACTIVATIONS: kept + extra}), [head, {C.ACTIVATIONS: layer}], host


def _scoring(shape: ModelShape, spec: A.ForwardSpec, tokens: int, seq: int, positions: int) -> list[dict]:
    """The moments of a no-grad pass over `tokens` (none: no pass): its layers, then its LM head at `positions`
    (none: no head) beside the final hidden states."""
    layers = {C.ACTIVATIONS: A.nograd_activations(shape, spec, tokens, seq) if tokens else 0}
    if not positions:
        return [layers, {C.LOGITS: 0}]
    return [layers, {C.LOGITS: A.head_logprobs_nograd(shape, spec, positions),
                     C.ACTIVATIONS: A.head_inputs(shape, spec, tokens, positions, backward=False)}]


def _transient_phases(shape: ModelShape, args: EstimateArguments, spec: A.ForwardSpec, trainable: list[int]) -> list:
    """(phase, held, moments, host) for what each phase adds on top of the resident components: `held` is
    alive through the phase, each moment's components are alive together, and the phase peaks at its largest
    moment (the layers of a pass and its LM head never hold their peaks at once); `host`: activation bytes
    offloaded to host memory."""
    grads = {C.GRADIENTS: gradient_bytes(trainable)}
    step = ("optimizer_step", {**grads, C.OPTIMIZER_TEMPORARIES: step_temporaries(trainable, args.optimizer)}, [{}], 0)
    mb, seq = args.micro_batch_size, args.max_length
    # SFT and DPO take log-probs at completion positions only, a chunk of the LM head at a time
    # (`output="logprobs"`, trainer.model.logprobs.head_logprobs): a chunk's logits, never the (tokens x V) whole.
    if args.stage == "sft":
        tokens = mb * seq
        return [("forward_backward", *_training(shape, spec, tokens, seq, tokens, grads)), step]
    if args.stage in ("reward", "dpo"):
        # Chosen and rejected of each pair, each with its prompt, at most max_length: 2 x mb x seq tokens is the
        # bound in either layout (one row per pair holds the prompt once). One row per pair is up to twice as long
        # (what eager attention's probabilities scale with) and carries a pair mask, bool plus attention's
        # additive copy of it. Reward scores read hidden states (no logits); DPO also runs the reference.
        tokens, row = 2 * mb * seq, seq
        mask = 0
        if args.share_pair_prompts and args.attn_implementation != "flash_attention_2":
            row = 2 * seq
            mask = mb * row * row * (1 + spec.dtype_bytes)
        positions = tokens if args.stage == "dpo" else 0  # reward scores read one position per row
        train = ("forward_backward", *_training(shape, spec, tokens, row, positions, grads, extra=mask))
        if args.stage == "reward":
            return [train, step]
        return [("reference", {C.ACTIVATIONS: mask}, _scoring(shape, spec, tokens, row, tokens), 0), train, step]
    rows = args.rollout_micro_batch_size
    context = args.max_prompt_length + args.max_new_tokens
    scored = rows * args.max_new_tokens  # the head runs at the response positions only (trainer.rl.scoring)
    update_positions = mb * args.max_new_tokens  # the policy rows' responses
    # Sampling: the KV cache through the phase; the prompt's forward, then per decode step (rows x V) logits:
    # the model's, and at most four fp32 buffers of the pick (trainer.model.decode.pick_tokens; top-p adds three).
    step_logits = rows * shape.vocab_size * (spec.dtype_bytes + 4 * 4)
    # The KV cache: grown per step (eager), or the compiled path's full-length one, kept in every phase (resident)
    generate_held = {} if args.decode == "compiled" else {
        C.KV_CACHE: A.kv_cache(shape, spec, rows, context) + A.kv_cache_growth(shape, spec, rows, context)}
    if args.generation_weights == "dequantized":  # made for the rollout's decoding, freed before scoring
        generate_held[C.GENERATION_WEIGHTS] = generation_weight_bytes(shape, spec.dtype_bytes, args)
    lora_copies = decode_lora_bytes(shape, args)
    if args.decode != "compiled" and lora_copies:  # the LoRA copies: this decode's only
        generate_held[C.GENERATION_WEIGHTS] = generate_held.get(C.GENERATION_WEIGHTS, 0) + lora_copies
    # the prompt's forward reads the dense copy where there is one: no 4-bit weight dequantized on the way
    prefill = replace(spec, nf4=spec.nf4 and args.generation_weights not in ("resident", "dequantized"))
    generate_moments = [{C.ACTIVATIONS: A.nograd_activations(shape, prefill, rows * args.max_prompt_length,
                                                             args.max_prompt_length)}, {C.LOGITS: step_logits}]
    groups = len(adapters(args)) - 1  # the policy's log-probs come from sampling
    # The scoring pass runs every adapter but the policy; only the reference gives log-probs (beta 0 and
    # reward functions in GRPO: no pass at all).
    score_moments = _scoring(shape, spec, groups * rows * context, context,
                             scored if REFERENCE in roles(args) else 0)
    if args.stage == "grpo":  # critic-free: the rollout rows are prompts x generations, one forward in the update
        rows_all = replace(args, rollout_batch_size=args.rollout_batch_size * args.num_generations)
        buffers = {C.ROLLOUT_BUFFERS: rollout_buffer_bytes(rows_all)}
        return [("generate", {**buffers, **generate_held}, generate_moments, 0),
                ("score", buffers, score_moments, 0),
                ("update", *_training(shape, spec, mb * context, context, update_positions, {**buffers, **grads})),
                step]
    # PPO as trainer.rl.rollout / trainer.rl.online run it: generation and scoring in chunks of
    # `rollout_micro_batch_size` rows. In the update, policy and value rows are one routed batch of two
    # trainable adapters: their layer inputs are kept, and a layer is recomputed for both.
    buffers = {C.ROLLOUT_BUFFERS: rollout_buffer_bytes(args)}
    return [("generate", {**buffers, **generate_held}, generate_moments, 0),
            ("score", buffers, score_moments, 0),
            ("update", *_training(shape, spec, 2 * mb * context, context, update_positions, {**buffers, **grads},
                                  adapters=2)),
            step]


def _merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out


def estimate(shape: ModelShape, args: EstimateArguments) -> dict:
    """The estimate in the recorder's JSON layout: one entry per phase, components in bytes."""
    args = args.resolved()
    if args.attn_implementation == "auto":  # as the model loads it: an eager one holds each layer's seq x seq scores
        args = replace(args, attn_implementation=resolve.attention("auto", args.device,
                                                                   resolve.class_of_model_type(shape.model_type))[0])
    res = resident(shape, args)
    spec = forward_spec(args, res["dtype_bytes"])
    phases = []
    for name, held, moments, host in _transient_phases(shape, args, spec, res["trainable"]):
        # the components at the phase's peak moment; each term's own peak in the phase beside them
        term_peaks = {k: max(_merged(held, m).get(k, 0) for m in moments) for k in _merged(held, *moments)}
        # a phase's own bytes add to the resident ones (generation_weights: a rollout's dense copy beside the
        # compiled step's kept LoRA copies, or an eager decode's LoRA copies beside a resident dense copy)
        comps = _merged(res["components"], dict.fromkeys(term_peaks, 0), held, max(moments, key=C.total))
        allocated = C.total(comps)
        comps[C.ALLOCATOR_OVERHEAD] = int(args.allocator_overhead * allocated)
        comps[C.CUDA_CONTEXT] = int(args.cuda_context_gib * C.GIB + args.cuda_kernels_gib * C.GIB) \
            if args.device == "cuda" else 0
        comps = {k: comps[k] for k in C.ordered(comps)}
        phase = {"stage": args.stage, "phase": name, "components": comps, "total": C.total(comps),
                 "peak_allocated": allocated, "term_peaks": term_peaks}
        elsewhere = {C.OPTIMIZER_STATES: res["optimizer"].host, C.ACTIVATIONS: host}
        if any(elsewhere.values()):
            phase["elsewhere"] = {"cpu": {k: v for k, v in elsewhere.items() if v}}
        if res["optimizer"].paged:
            phase["paged"] = {C.OPTIMIZER_STATES: res["optimizer"].paged}
        phases.append(phase)
    peak = max(phases, key=lambda p: p["total"])
    for phase in phases:
        # what the device holds during the phase once a step has run: PyTorch's caching allocator keeps the
        # blocks of the largest phase reserved for the next step (nothing empties its cache), so every phase's
        # device memory is the peak phase's, whatever the phase itself allocates
        phase["device_total"] = peak["total"]
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
           if args.gradient_checkpointing else "no checkpointing: every layer's saved tensors live until backward")
        + ("; under autocast the LoRA matmuls save compute-dtype casts of their inputs and weights"
           if args.mixed_precision != "no" else ""),
        "logits: every stage holds one chunk of the LM head's output (2^24 logits) and its fp32 temporaries "
        "(trainer.model.logprobs.head_logprobs), never the (tokens x vocab) whole; sampling holds each decode "
        "step's logits",
        "each phase is shown at its peak moment: a pass's layers and its LM head never peak together, so a "
        "term that peaks at another moment reads 0 there (its own peak: `term_peaks` in the JSON)",
        f"allocator_overhead is an assumption ({args.allocator_overhead:.0%} of allocated); cuda_context "
        f"({args.cuda_context_gib:.3g} GiB) is measured at a run's start where NVML reads it, else assumed, and "
        f"{args.cuda_kernels_gib:.3g} GiB more is assumed for the kernels CUDA loads as the run first calls them",
        "optimizer_states are the steady state after the first step; gradients are fp32 LoRA/head gradients",
    ]
    if args.stage in ONLINE_RL_STAGES:
        notes.append(f"adapters on the base: {', '.join(roles(args))}"
                     + ("" if args.reward_model else "; scores from reward functions (no reward adapter or pass)")
                     + ("; beta 0: no reference adapter or pass" if REFERENCE not in roles(args) else ""))
    if args.stage == "ppo":
        notes.append("ppo update: policy and value rows in one routed forward; the optimizer step of ppo is "
                     "listed as its own phase")
    if args.optimizer == "paged_adamw_8bit":
        notes.append("paged 8-bit states are CUDA managed memory: same bytes, but they can spill to host RAM "
                     "and torch.cuda.memory_allocated does not count them")
    return notes
