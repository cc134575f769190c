"""The online-RL path PPO, GRPO and RLOO share: one step, one state, one training loop.

    rollout      G responses per prompt, sampled and scored (`trainer.rl.rollout`)
    advantages   the method's maths (`trainer.rl.algorithms`)
    update       epochs of shuffled minibatches of the method's loss (`trainer.rl.update`)
    after        what the method carries to the next step (PPO: its KL controller)

A method is an `Algorithm`: which passes its rollout needs, and its advantages, loss and metrics. `rl_step` is
the same function for training (`train_online`, which trainer/ppo.py and trainer/grpo.py run) and the
benchmarks. What a run carries between steps is `RLState`, checkpointed. Each part is a phase
(`trainer.engine.phases`): the memory recorder and a benchmark's clock watch them.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from foundation.cli import UsageError
from foundation.settings import training_lora_dropout
from foundation.stages import REFERENCE
from profiling.decode import bandwidth_fraction, bytes_per_decode_step, copy_bandwidth
from trainer.data.collators import PromptCollator
from trainer.engine.harness import Engine, Harness, StepResult
from trainer.engine.phases import phase
from trainer.model.decode import Generator, Sampling
from trainer.model.shared_base import stage_specs
from trainer.rl.kl_control import KLController
from trainer.rl.policy_eval import policy_vs_reference
from trainer.rl.reward_worker import TrainerState
from trainer.rl.rewards import Scorer
from trainer.rl.rollout import Rollout, make_rollout
from trainer.rl.update import Update, run_update

logger = logging.getLogger(__name__)


@dataclass
class RLState:
    """What an online-RL run carries from step to step; saved in every checkpoint."""

    minibatch_rng: torch.Generator  # minibatch order
    micro_batch_size: int  # the update's micro-batch, halved after an out-of-memory error
    kl: Optional[KLController] = None  # PPO's KL coefficient and its controller
    steps_here: int = 0  # steps taken by this process (not saved): the first one meters saved activations
    decode_bound: Optional[tuple[float, int]] = None  # CUDA: (copy bandwidth, bytes read per decode step)

    def state_dict(self) -> dict[str, Any]:
        saved = {"minibatch_rng": self.minibatch_rng.get_state().tolist(), "update_micro_batch": self.micro_batch_size}
        return saved if self.kl is None else {"kl_controller": self.kl.state_dict(), **saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl is not None:
            try:
                self.kl.load_state_dict(state["kl_controller"])
            except ValueError as exc:  # adaptive_kl changed, and --resume_config_check false let it through
                raise UsageError(f"{exc}: resume with the --adaptive_kl setting the checkpoint was saved with") from None
        self.minibatch_rng.set_state(torch.tensor(state["minibatch_rng"], dtype=torch.uint8))
        self.micro_batch_size = state.get("update_micro_batch", self.micro_batch_size)


class Algorithm(ABC):
    """A method's part of the step. Subclasses set the class attributes and write the maths."""

    name = "RL"  # in messages
    value = False  # the rollout reads the value adapter (a critic)
    nan_unscored = False  # a response no reward function scored is NaN (left out of its group), not 0
    grad_norm_key = "grad_norm"  # the gradient norm's metric name

    def __init__(self, args, epochs: int, group: int = 1, reference: bool = True):
        self.args, self.epochs, self.group, self.reference = args, epochs, group, reference

    def start(self, micro_batch_size: int, seed: int) -> RLState:
        return RLState(torch.Generator().manual_seed(seed), micro_batch_size, kl=self.kl_controller())

    def kl_controller(self) -> Optional[KLController]:
        return None

    @abstractmethod
    def advantages(self, rollout: Rollout, state: RLState):
        """What the loss reads besides the rollout; its `buffers()` are tracked as rollout buffers."""

    @abstractmethod
    def metrics(self, rollout: Rollout, adv, state: RLState) -> dict[str, float]:
        """The rollout's figures, under the method's usual (TRL's) names."""

    @abstractmethod
    def loss(self, model, rollout: Rollout, adv, rows: torch.Tensor, temperature: float) -> tuple[torch.Tensor, dict]:
        """The loss of rollout rows `rows`, a mean over `loss_units(rollout, rows)`, and its detached statistics."""

    def loss_units(self, rollout: Rollout, rows: torch.Tensor):
        """What the loss of `rows` is a mean over: their response tokens (the default) or their rows."""
        return rollout.response_mask[rows].sum()

    def after_update(self, metrics: dict[str, float], state: RLState, accelerator) -> None:
        """Carry what the step learned to the next one (PPO: the KL controller)."""


def rl_step(engine: Engine, generator: Generator, batch: dict[str, torch.Tensor], algorithm: Algorithm,
            state: RLState, scorer: Scorer, eos_id: int, pad_id: int) -> StepResult:
    """Rollout (sampled by `generator`, on `engine.raw`) -> advantages -> update -> after, for one batch of
    prompts."""
    acc, raw, args = engine.accelerator, engine.raw, algorithm.args
    started = time.perf_counter()
    # Generation and the no-grad scoring passes go around the DDP / DeepSpeed wrapper (DDP has no
    # generate, and no gradient sync is wanted there); the update goes through it. Both run under the run's
    # autocast: the old log-probs come from the products the update's first forward computes again.
    with acc.autocast():
        rollout = make_rollout(generator, batch["input_ids"].to(acc.device), batch["attention_mask"].to(acc.device), args,
                               scorer, eos_id, pad_id, group=algorithm.group, reference=algorithm.reference,
                               value=algorithm.value, nan_unscored=algorithm.nan_unscored,
                               examples=batch.get("examples"))
    adv = algorithm.advantages(rollout, state)
    metrics = algorithm.metrics(rollout, adv, state)
    rollout_s = time.perf_counter() - started

    engine.model.train()
    engine.recorder.track(rollout_buffers=rollout.buffers() + adv.buffers())
    lr = engine.scheduler.get_last_lr()[0]
    started = time.perf_counter()
    with phase("update", count_saved=state.steps_here == 0):
        stats, finite, stepped = rl_update(engine, algorithm, rollout, adv, state,
                                           Sampling.of(args).scoring_temperature)
    update_s = time.perf_counter() - started
    state.steps_here += 1
    engine.recorder.track(rollout_buffers=[])

    algorithm.after_update(metrics, state, acc)
    metrics.update(stats)
    metrics.update(decode_metrics(raw, rollout, generator.pass_rows(rollout.rows), state, generator.weights.choice))
    metrics.update({"lr": lr, "perf/rollout_s": rollout_s, "perf/update_s": update_s,
                    "perf/generate_tokens_per_s": rollout.response_mask.sum().item() / max(rollout_s, 1e-9),
                    "perf/update_tokens_per_s": rollout.attention_mask.sum().item() * algorithm.epochs
                    / max(update_s, 1e-9),
                    "perf/update_micro_batch": float(state.micro_batch_size)})
    return StepResult(metrics, finite=finite, stepped=stepped)


def rl_update(engine: Engine, algorithm: Algorithm, rollout: Rollout, adv, state: RLState,
              temperature: float) -> tuple[dict[str, float], bool, bool]:
    """`algorithm.epochs` passes of shuffled minibatches over the rollout, each micro-batch's loss the
    algorithm's (`trainer.rl.update`): (mean statistics, every minibatch finite, any stepped)."""
    update = Update(algorithm.name, algorithm.epochs, algorithm.args.mini_batch_size,
                    loss_of=lambda rows: algorithm.loss(engine.model, rollout, adv, rows, temperature),
                    count_of=lambda rows: algorithm.loss_units(rollout, rows), grad_norm_key=algorithm.grad_norm_key)
    return run_update(engine, state, update, rollout.rows)


def decode_metrics(model, rollout: Rollout, rows_per_call: int, state: RLState,
                   weights: str = "quantized") -> dict[str, float]:
    """Decoded positions per second of the rollout's generation (prefill included), and on CUDA that
    speed over the bandwidth bound (rows decoded together x copy bandwidth / bytes one step reads from
    `weights`, --generation_weights; the bandwidth is measured once per run by a device copy)."""
    tokens_per_s = rollout.rows * rollout.response_length / max(rollout.generate_s, 1e-9)
    out = {"perf/decode_tokens_per_s": tokens_per_s}
    device = rollout.input_ids.device
    if device.type == "cuda":
        if state.decode_bound is None:
            state.decode_bound = (copy_bandwidth(device), sum(bytes_per_decode_step(model, weights=weights).values()))
        bandwidth, step_bytes = state.decode_bound
        out["perf/decode_bandwidth_fraction"] = bandwidth_fraction(tokens_per_s, min(rows_per_call, rollout.rows),
                                                                   step_bytes, bandwidth)
    return out


def build_online_model(ctx, stage: str, sources: dict[str, Optional[str]], without: tuple[str, ...] = ()):
    """Stage `stage`'s adapters (`foundation.stages`, from the folders in `sources`, less `without`) on one base,
    trained without LoRA dropout (`training_lora_dropout`, said in one line where the settings had some)."""
    model_args = ctx.model_args
    dropout = training_lora_dropout(stage, model_args.lora_dropout)
    if dropout != model_args.lora_dropout:
        logger.info("%s trains without LoRA dropout: lora_dropout %s -> %g", stage.upper(), model_args.lora_dropout,
                    dropout)
        model_args = replace(model_args, lora_dropout=dropout)
    return ctx.build_model(stage_specs(stage, sources, without=without), model_args)


def train_online(ctx, stage: str, model, algorithm: Algorithm, adapters: list[str], prompts, held_out,
                 scorer: Scorer, log_keys: list[str]) -> RLState:
    """Stage `stage`: train `adapters` of `model` with `algorithm` for train_args.max_steps steps, evaluating
    the policy against the reference on `held_out` prompts; returns the state the run ended in."""
    args, targs, plan, tok = ctx.stage_args, ctx.train_args, ctx.plan, ctx.tokenizer
    state = algorithm.start(plan.micro_batch_size, targs.seed)
    if algorithm.group > 1:
        logger.info("%s: %d prompts x %d responses = %d rows per step", algorithm.name, args.rollout_batch_size,
                    algorithm.group, args.rollout_batch_size * algorithm.group)

    def evaluate(engine: Engine) -> dict[str, float]:
        if REFERENCE not in model.adapter_names:  # GRPO with beta 0: no reference to compare with
            return {}
        return policy_vs_reference(generator, held_out, args, scorer, tok.eos_token_id, tok.pad_token_id,
                                   ctx.accelerator, progress=targs.progress_bar) or {}

    harness = Harness(ctx, model, stage, adapters, prompts, PromptCollator(tok.pad_token_id), evaluate,
                      batch_size=args.rollout_batch_size, extra_state=state,
                      accumulation_steps=args.mini_batch_size // plan.micro_batch_size, log_keys=log_keys)
    # the run's one decoder, for its rollouts and evaluations; its memory record counts what it holds
    generator = Generator(harness.engine.raw, plan.decode, plan.generation_weights, recorder=harness.engine.recorder,
                          rows=plan.rollout_micro_batch_size)

    def step(step_number: int, batches) -> StepResult:
        scorer.trainer_state = TrainerState.before_step(step_number, targs.max_steps, args.rollout_batch_size,
                                                        len(prompts))
        return rl_step(harness.engine, generator, next(batches), algorithm, state, scorer, tok.eos_token_id, tok.pad_token_id)

    harness.train(step)
    if state.micro_batch_size != plan.micro_batch_size:
        logger.warning("the update settled on micro-batch %d (asked for %d) after running out of memory",
                       state.micro_batch_size, plan.micro_batch_size)
    return state
