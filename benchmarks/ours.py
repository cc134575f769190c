"""Our side: `trainer.rl.online.rl_step` with `PPO` - the very step `trainer/ppo.py` trains with - on ONE
base carrying four LoRA adapters, set up as training sets it up (`Engine`), without the harness
around it (no evaluation, logging or checkpoints). A step is timed as rollout (generate; policy,
reward, reference and value passes; advantages) and update, split where the step enters its
"update" phase (`trainer.engine.phases`, which the clock watches).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.kernels import profile_step
from benchmarks.measure import PhaseClock, StepCounter, step_record
from benchmarks.workload import Workload
from foundation.run_plan import RunPlan
from profiling.device import MemoryProbe
from trainer.data.collators import PromptCollator
from trainer.data.tokenization import PromptExample
from trainer.engine.harness import Engine
from trainer.model.shared_base import build_shared_model, stage_specs
from trainer.engine.phases import watching
from trainer.rl.algorithms.ppo import PPO
from trainer.model.decode import Generator
from trainer.rl.online import rl_step
from trainer.rl.rewards import Scorer

logger = logging.getLogger(__name__)


def describe(args: Workload, plan: RunPlan, optimizer_name: str) -> dict:
    base = "4-bit NF4 (double quant)" if plan.quantization == "nf4" else "full precision"
    return {
        "models": f"ONE {args.model_name_or_path} base ({base}), frozen, loaded once",
        "policy": f"LoRA adapter 'policy' (trainable; r={args.lora_r}, alpha={args.lora_alpha}, "
                  f"{args.lora_target_modules})",
        "reference": "LoRA adapter 'reference' on the same base (frozen; fresh, so equal to the base)",
        "value": "LoRA adapter 'value' + scalar head (trainable) on the same base",
        "reward": "LoRA adapter 'reward' + scalar head (frozen; fresh adapter, shared head weights) on the same base",
        "optimizer": optimizer_name,
        "gradient_checkpointing": plan.gradient_checkpointing,
        "scoring": "ONE routed pass of the base for reference / value / reward (each row group through its own "
                   "adapter), and one for policy + value in the update; only the response positions' outputs are "
                   "computed",
        "old log-probs": "from the logits each token was sampled from (no policy scoring pass)",
        "generation": f"through the LoRA layers, decode {plan.decode}, from {plan.generation_weights} "
                      "weights (as the stage's budget plan picks them)",
        "step": "trainer.rl.online.rl_step with trainer.rl.algorithms.ppo.PPO (the step trainer/ppo.py trains with)",
    }


def as_the_stage_plans(stage: str, args, accelerator) -> RunPlan:
    """The workload's run plan as the stage settles it at its start (`trainer.engine.settle`): the decode path
    and generation weights, where its command leaves them auto, as the stage's budget plan picks them (on with
    CUDA), so our side decodes as a run of the stage does. The work itself (micro-batches, checkpointing,
    offloads) is given (`benchmarks.workload.WORK_DEFAULTS`), the same for both sides."""
    from trainer.engine.launch import Launch
    from trainer.engine.settle import settle

    settings = (args.model, args.data, args.train, getattr(args, stage))
    return settle(stage, settings, accelerator.device, Launch.of(accelerator))


def build_model(args: Workload, plan: RunPlan, vocab_size: int, device: torch.device, head_dirs: dict[str, str]):
    """ONE base with PPO's adapters (foundation.stages' table); the value and reward heads from files."""
    specs = stage_specs("ppo", {})
    for spec in specs:
        spec.head_from = head_dirs.get(spec.name) if spec.head else None
    return build_shared_model(args.model, specs, vocab_size=vocab_size, device=device, plan=plan)


class StepPhases:
    """A phase watcher for rl_step: times each part, and closes the rollout lap where the update begins."""

    def __init__(self, clock: PhaseClock):
        self.clock, self.rollout = clock, None

    @contextmanager
    def __call__(self, name: str, **_options):
        if name == "update":
            self.rollout = self.clock.lap()
        with self.clock.subphase(name):
            yield


def run_ours(args: Workload, prompts: list[list[int]], tokenizer, accelerator, probe: MemoryProbe,
             head_dirs: dict[str, str], result: dict) -> None:
    """Fill `result` (setup, steps) in place, so a failure part-way keeps what was measured."""
    device = accelerator.device
    plan = as_the_stage_plans("ppo", args, accelerator)
    clock = PhaseClock(probe)
    clock.start()
    model = build_model(args, plan, len(tokenizer), device, head_dirs)
    engine = Engine(model, args.train, accelerator, "ppo", accumulation_steps=args.mini_batch_size // plan.micro_batch_size,
                    optimizer=plan.optimizer)
    setup = clock.lap()
    optimizer_name = getattr(engine.optimizer.optimizer, "resolved_name", type(engine.optimizer.optimizer).__name__)
    result["setup"] = describe(args, plan, optimizer_name)
    result["setup"]["trainable_parameters"] = sum(p.numel() for p in model.trainable_parameters())
    result["setup"]["compiled decoder layers"] = (
        f"{model.compiled_parts} (--compile_layers: for the passes that train, each with its checkpoint)"
        if model.compiled_parts else "none")
    result.update(setup_s=setup.seconds, setup_peak=setup.peaks, resident_after_setup=probe.now())

    run_steps(engine, PPO(args.ppo), Scorer(), args, plan, prompts, tokenizer, clock, result,
              lambda state: {"response_tokens": args.tokens()["generated"], "update_micro_batch": state.micro_batch_size},
              args.bench.kernel_profile)


def run_steps(engine: Engine, algorithm, scorer, args, plan: RunPlan, prompts: list[list[int]], tokenizer, clock: PhaseClock,
              result: dict, record: Callable[[Any], dict] = lambda state: {},
              kernel_profile: Optional[str] = None) -> None:
    """`args.total_steps` steps of `algorithm` through `rl_step` (the stage's own step) on `args.rollout_batch_size`
    prompts each, the first `args.warmup_runs` marked warm-up: each step's rollout and update laps, parts and
    optimizer steps (and what `record` adds from the algorithm's state) appended to result["steps"] as they
    come, the last step's metrics in result["metrics"]. With `kernel_profile` (a folder) one more step on the
    first prompts runs under the profiler (`benchmarks.kernels`). Accelerate's references to the model and
    optimizer are dropped after, also on errors."""
    collate = PromptCollator(tokenizer.pad_token_id)
    state = algorithm.start(plan.micro_batch_size, args.seed)
    generator = Generator(engine.raw, plan.decode, plan.generation_weights, recorder=engine.recorder,
                          rows=plan.rollout_micro_batch_size)
    phases, counter, b = StepPhases(clock), StepCounter(engine.optimizer), args.rollout_batch_size
    try:
        for i in range(args.total_steps):
            batch = collate([PromptExample(r, "bench") for r in prompts[i * b : (i + 1) * b]])
            clock.start()
            with watching(phases):
                out = rl_step(engine, generator, batch, algorithm, state, scorer, tokenizer.eos_token_id,
                              tokenizer.pad_token_id)
            update_lap = clock.lap()
            result["steps"].append(step_record(i + 1, i < args.warmup_runs, phases.rollout, update_lap, clock.parts,
                                               optimizer_steps=counter.take(), **record(state)))
            result["metrics"] = {k: float(v) for k, v in out.metrics.items()}
            logger.info("ours step %d: rollout %.2fs, update %.2fs", i + 1, phases.rollout.seconds,
                        update_lap.seconds)
        if kernel_profile:
            batch = collate([PromptExample(r, "bench") for r in prompts[:b]])
            profile_step(lambda: rl_step(engine, generator, batch, algorithm, state, scorer, tokenizer.eos_token_id,
                                         tokenizer.pad_token_id),
                         engine.accelerator.device, Path(kernel_profile), f"{type(algorithm).__name__} step, ours")
    finally:
        counter.remove()
        engine.accelerator.free_memory()
