"""The budget planner of the online RL stages (PPO, GRPO / RLOO): batch sizes, gradient checkpointing, the
offloads and the decode weights picked from the estimator and the memory budget, so a run uses the card
instead of a guess. It chooses only the settings the run left auto (`planned`); a value given is kept.

    plan_rl(shape, settings, planned=...) -> Plan(rollout_micro_batch_size, micro_batch_size, ...)

Each choice is the largest whose estimated peak fits the budget less `margin` (room for fragmentation), or, where
nothing fits that, the whole budget (what the run's start-up check accepts): first the rows per generate / score
pass, then the update micro-batch, without checkpointing when that fits at least half of what checkpointing allows
(not with the activations offloaded: the estimate is then alike either way, while without checkpointing every
saved tensor crosses to the host, not just each layer's input); where nothing fits, the same with the input
embedding in host memory, then with the update's saved activations there, then with both.
Where `decode` is auto on CUDA, all this is done with the compiled decode step (its full-length KV cache held
in every phase; no embedding offload, which a captured step cannot read) and with eager decoding: the compiled
plan wins where it keeps at least half the rows per generate pass.
Then, where `generation_weights` is auto, a 4-bit base on CUDA decoding more than one row at a time gets the
dense copy of its weights that still fits within the margin: resident, else made per rollout, else none.
Nothing runs a model: the update's OOM back-off stays the safety net.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Collection, Optional, Sequence

from foundation.cli import unplanned
from foundation.settings import ONLINE_RL_STAGES
from profiling import components as C
from profiling.predict import EstimateArguments, estimate, offloaded_embedding
from profiling.shapes import ModelShape

ROLLOUT_PHASES = ("generate", "score")
UPDATE_PHASES = ("update", "optimizer_step")
OFFLOADS = ("offload_embeddings", "offload_activations")  # tried alone in this order, then together
# What the planner may choose; generation_weights is chosen where it is "auto" (a value of its own).
PLANNABLE = ("rollout_micro_batch_size", "micro_batch_size", "gradient_checkpointing", *OFFLOADS)


@dataclass(frozen=True)
class Plan:
    rollout_micro_batch_size: int
    micro_batch_size: int
    gradient_checkpointing: bool
    offload_embeddings: bool
    offload_activations: bool
    generation_weights: str  # what decoding reads: quantized, dequantized or resident (trainer.model.decode)
    decode: str  # the rollouts' decode path: eager or compiled (trainer.model.decode)
    peak_bytes: int
    peak_phase: str
    usable_bytes: int
    budget_bytes: int
    phases: tuple[tuple[str, int], ...]  # (phase, estimated total bytes)

    planned: frozenset[str] = frozenset(PLANNABLE)  # the settings the planner chose; the others were given

    def settings(self) -> dict:
        """The values of the settings a plan holds (PLANNABLE, generation_weights, decode), by field name."""
        return {name: getattr(self, name) for name in (*PLANNABLE, "generation_weights", "decode")}

    def table(self) -> str:
        """The plan, each setting marked set (given) or planned, and the predicted peak per phase, as the log
        prints it at the start of a run."""
        header, *phases = self.estimate_table().splitlines()
        settings = [f"  {name} {_shown(value)}  ({'planned' if name in self.planned else 'set'})"
                    for name, value in self.settings().items()]
        return "\n".join([header, *settings, *phases])

    def estimate_table(self) -> str:
        """The predicted peak per phase, under the budget it was planned within."""
        lines = [f"budget plan (estimate within {C.gib(self.usable_bytes)} of {C.gib(self.budget_bytes)} GiB):"]
        for phase, total in self.phases:
            mark = "  <- peak" if phase == self.peak_phase else ""
            lines.append(f"  {phase:<15} {C.gib(total):>7} GiB{mark}")
        return "\n".join(lines)


def _shown(value) -> str:
    """A setting's value as a flag takes it (true / false for a bool)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


@functools.lru_cache(maxsize=1024)  # a plan within the whole budget tries again the settings tried within the margin
def _peaks(shape: ModelShape, args: EstimateArguments) -> dict[str, int]:
    return {p["phase"]: p["total"] for p in estimate(shape, args)["phases"]}


def _largest(shape: ModelShape, args: EstimateArguments, field: str, sizes: list[int], phases: tuple[str, ...],
             usable: int) -> Optional[int]:
    for size in sizes:
        peaks = _peaks(shape, replace(args, **{field: size}))
        if all(total <= usable for name, total in peaks.items() if name in phases):
            return size
    return None


def plan_rl(shape: ModelShape, args: EstimateArguments, mini_batch_size: int, margin: float = 0.1,
            may_offload: Sequence[str] = OFFLOADS, planned: Collection[str] = PLANNABLE) -> Optional[Plan]:
    """The plan for a PPO or GRPO run (`args.stage`; EstimateArguments of the run) with minibatches of
    `mini_batch_size` rows; None when nothing fits the whole budget with the settings given. Only the settings
    in `planned` (of PLANNABLE) are chosen; the others keep their values in `args` (auto: `unplanned`). Where
    nothing fits, the offloads the run allows (`may_offload`, planned ones) are turned on, each alone in OFFLOADS'
    order and then together, until a plan fits; an offload that would change nothing (a tied embedding, the CPU)
    is not tried.
    All that within the budget less `margin`, else within the whole budget; a dense copy for decoding only ever
    within the margin (it saves time, never a run)."""
    planned, args = frozenset(planned) & frozenset(PLANNABLE), unplanned(args)
    plan = _plan_within(shape, args, mini_batch_size, margin, may_offload, planned)
    if plan is None and margin > 0:  # a value given may fit only the whole budget: plan the rest around it
        plan = _plan_within(shape, args, mini_batch_size, 0.0, may_offload, planned)
    if plan is None or args.generation_weights != "auto":
        return plan
    plan = replace(plan, planned=plan.planned | {"generation_weights"})
    settled = replace(args, decode=plan.decode, **{name: getattr(plan, name) for name in PLANNABLE}).resolved()
    if settled.quantization != "nf4" or settled.device != "cuda" or plan.rollout_micro_batch_size < 2:
        return plan  # one row decodes through bitsandbytes' 4-bit kernel, which reads 4 bits a weight
    for weights in ("resident", "dequantized"):
        est = estimate(shape, replace(settled, generation_weights=weights))
        if all(p["total"] <= _usable(settled, margin) for p in est["phases"]):
            return _plan_of(replace(settled, generation_weights=weights), est, plan.usable_bytes, plan.planned)
    return plan


def _plan_within(shape: ModelShape, args: EstimateArguments, mini_batch_size: int, margin: float,
                 may_offload: Sequence[str], planned: frozenset[str]) -> Optional[Plan]:
    """The plan of the batch sizes, checkpointing, offloads and decode path within the budget less `margin`."""
    if args.decode == "auto" and args.device == "cuda" and not args.offload_embeddings:
        # the compiled step (no embedding offload: a captured step cannot look rows up in host memory) where a
        # plan with its resident KV cache keeps at least half the rows per pass eager decoding gets: a compiled
        # step is several times faster at the same rows (benchmarks/results/speed-*), not at a quarter of them
        compiled = _with_offloads(shape, replace(args, decode="compiled"), mini_batch_size, margin,
                                  [name for name in may_offload if name != "offload_embeddings"], planned)
        eager = _with_offloads(shape, replace(args, decode="eager"), mini_batch_size, margin, may_offload, planned)
        plan = compiled if compiled is not None and (
            eager is None or 2 * compiled.rollout_micro_batch_size >= eager.rollout_micro_batch_size) else eager
        return plan and replace(plan, planned=plan.planned | {"decode"})
    return _with_offloads(shape, args, mini_batch_size, margin, may_offload, planned)


def _usable(args: EstimateArguments, margin: float) -> int:
    return int(args.budget_bytes * (1 - margin))


def _with_offloads(shape: ModelShape, args: EstimateArguments, mini_batch_size: int, margin: float,
                   may_offload: Sequence[str], planned: frozenset[str]) -> Optional[Plan]:
    """The plan with the settings given; where nothing fits, with the offloads allowed and planned turned on,
    each alone in OFFLOADS' order, then together (one that moves nothing is not tried)."""
    plan = _plan_rl(shape, args, mini_batch_size, margin, planned)
    allowed = [name for name in OFFLOADS if name in may_offload and name in planned and not getattr(args, name)]
    tries = [[name] for name in allowed] + ([allowed] if len(allowed) > 1 else [])
    for names in tries:
        if plan is not None:
            break
        offloaded = replace(args, **dict.fromkeys(names, True))
        if all(_moves_something(shape, offloaded.resolved(), name) for name in names):
            plan = _plan_rl(shape, offloaded, mini_batch_size, margin, planned)
    return plan


def auto_fit_on(auto_fit: Optional[bool], device: str) -> bool:
    """--auto_fit as a run reads it: its value where given, else on with CUDA and off on the CPU."""
    return auto_fit if auto_fit is not None else device == "cuda"


def plans(args: EstimateArguments, planned: Collection[str]) -> bool:
    """Whether an estimate of `args` is planned as the run would plan it at its start: PPO or GRPO with --auto_fit
    on and some setting left auto (`planned`)."""
    return bool(args.stage in ONLINE_RL_STAGES and auto_fit_on(args.auto_fit, args.device) and planned)


def rollout_rows(args: EstimateArguments) -> int:
    """Rows a PPO or GRPO step samples: its prompts, times GRPO's responses per prompt."""
    return args.rollout_batch_size * (args.num_generations if args.stage == "grpo" else 1)


def offload_conflict(offload: str, decode: str, compile_layers: bool, sharded: Optional[str] = None) -> Optional[str]:
    """Why `offload` (OFFLOADS) cannot run with a run's other settings - the rest of a one-line refusal after its
    flag - or None where it can. `sharded` names the launch that partitions the base (ZeRO-3, FSDP), if any. The
    one rule for the run's start-up check (`trainer.engine.settle`) and the planner (`offloads_allowed`):
    neither offload where the base is partitioned, the embedding only with eager decoding, given or auto (a
    compiled decode step cannot look rows up in host memory; auto then decodes eagerly), the activations not
    through compiled layers (they run no saved-tensor hooks)."""
    if sharded and offload == "offload_embeddings":
        return f"is not supported under {sharded}, which partitions the embedding across ranks already; drop --{offload}"
    if sharded:
        return (f"is not supported under {sharded}: the weights it gathers would be taken for activations and copied "
                f"to the host; drop --{offload}")
    if offload == "offload_embeddings" and decode == "compiled":
        return ("needs --decode eager: each decode step looks its token's row up in host memory, which a compiled "
                "decode step cannot capture")
    if offload == "offload_activations" and compile_layers:
        return "and --compile_layers do not combine: compiled layers do not run saved-tensor hooks; drop one"
    return None


def offloads_allowed(decode: str, compile_layers: bool, sharded: bool = False) -> tuple[str, ...]:
    """The offloads a plan may turn on (`offload_conflict`: none with the others' settings)."""
    return tuple(name for name in OFFLOADS if offload_conflict(name, decode, compile_layers, "sharded" if sharded
                                                                else None) is None)


def planned_settings(shape: ModelShape, args: EstimateArguments, planned: Collection[str]) -> tuple[
        EstimateArguments, Optional[Plan]]:
    """(the settings with the plan's choices, the plan) of a PPO or GRPO estimate whose `planned` settings were
    left auto, as the run plans them at its start on CUDA; the settings as they are where nothing fits."""
    plan = plan_rl(shape, args, args.mini_batch_size, planned=planned,
                   may_offload=offloads_allowed(args.decode, args.compile_layers))
    if plan is None:
        return args, None
    return replace(args, **plan.settings()), plan


PHASE_SETTINGS = {**dict.fromkeys(ROLLOUT_PHASES, ("rollout_micro_batch_size",)),
                  **dict.fromkeys(UPDATE_PHASES, ("micro_batch_size", "gradient_checkpointing"))}  # the rest: OFFLOADS


def what_does_not_fit(shape: ModelShape, args: EstimateArguments, may_offload: Sequence[str] = OFFLOADS,
                      planned: Collection[str] = PLANNABLE) -> tuple[str, str, EstimateArguments, dict]:
    """Where `plan_rl` finds nothing: (the settings that do not fit, as "--name value" where given, the phase they
    are over the budget in, the settings estimated, their estimate), with the settings left auto at their least:
    one row a pass, micro-batches of one, checkpointing, every offload allowed that moves something, eager
    decoding. The phase is the first over the budget that a given setting bears on; where none does, the peak,
    named with its settings' least values."""
    planned, args = frozenset(planned) & frozenset(PLANNABLE), unplanned(args)
    least = {"rollout_micro_batch_size": 1, "micro_batch_size": 1, "gradient_checkpointing": True,
             **{name: name in may_offload and _moves_something(shape, replace(args, **{name: True}).resolved(), name)
                for name in OFFLOADS}}
    at = replace(args, decode="eager" if args.decode == "auto" else args.decode,
                 **{name: value for name, value in least.items() if name in planned})
    est = estimate(shape, at)
    offloads = tuple(name for name in OFFLOADS if name not in planned and not getattr(at, name) and least[name])
    over = [p["phase"] for p in est["phases"] if p["total"] > at.budget_bytes] or [est["peak_phase"]]
    bearing = {phase: [name for name in (*PHASE_SETTINGS[phase], *offloads) if name not in planned] for phase in over}
    phase = next((phase for phase in over if bearing[phase]), est["peak_phase"])  # the peak is over where any is
    if bearing[phase]:
        what = " with ".join(f"--{name} {_shown(getattr(at, name))}" for name in bearing[phase])
    else:
        what = "even " + " with ".join(f"{name} {_shown(getattr(at, name))}" for name in PHASE_SETTINGS[phase])
    return what, phase, at, est


def _moves_something(shape: ModelShape, args: EstimateArguments, offload: str) -> bool:
    if offload == "offload_embeddings":
        return offloaded_embedding(shape, args)
    return args.device == "cuda"


def _plan_rl(shape: ModelShape, args: EstimateArguments, mini_batch_size: int, margin: float,
             planned: frozenset[str]) -> Optional[Plan]:
    args = args.resolved()
    if args.stage not in ONLINE_RL_STAGES:
        raise ValueError(f"the planner plans online RL stages (ppo, grpo), not {args.stage!r}")
    usable = _usable(args, margin)
    total = rollout_rows(args)
    rows = _largest(shape, args, "rollout_micro_batch_size",
                    _divisors(total) if "rollout_micro_batch_size" in planned else [args.rollout_micro_batch_size],
                    ROLLOUT_PHASES, usable)
    if rows is None:
        return None
    args = replace(args, rollout_micro_batch_size=rows)
    sizes = _divisors(mini_batch_size) if "micro_batch_size" in planned else [args.micro_batch_size]
    checkpointing = (True, False) if "gradient_checkpointing" in planned else (args.gradient_checkpointing,)
    fits = {ckpt: _largest(shape, replace(args, gradient_checkpointing=ckpt), "micro_batch_size", sizes,
                           UPDATE_PHASES, usable) for ckpt in checkpointing}
    with_ckpt, without = fits.get(True), fits.get(False)
    # recomputation is worth it where it at least doubles the micro-batch, and always with the activations
    # offloaded: without checkpointing every saved tensor crosses to the host (a cost the estimate leaves out)
    if without is not None and (with_ckpt is None or (without > with_ckpt if args.offload_activations
                                                      else 2 * without >= with_ckpt)):
        args = replace(args, gradient_checkpointing=False, micro_batch_size=without)
    elif with_ckpt is not None:
        args = replace(args, gradient_checkpointing=True, micro_batch_size=with_ckpt)
    else:
        return None
    return _plan_of(args, estimate(shape, args), usable, planned)


def _plan_of(args: EstimateArguments, est: dict, usable: int, planned: frozenset[str]) -> Plan:
    return Plan(rollout_micro_batch_size=args.rollout_micro_batch_size, micro_batch_size=args.micro_batch_size,
                gradient_checkpointing=args.gradient_checkpointing, offload_embeddings=args.offload_embeddings,
                offload_activations=args.offload_activations, generation_weights=args.generation_weights,
                decode=args.decode,
                peak_bytes=est["peak_bytes"], peak_phase=est["peak_phase"], usable_bytes=usable,
                budget_bytes=args.budget_bytes, phases=tuple((p["phase"], p["total"]) for p in est["phases"]),
                planned=planned)
