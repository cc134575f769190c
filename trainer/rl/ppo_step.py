"""One PPO step, the same function for training (`trainer/ppo.py`) and the benchmarks:

    rollout (generate, score, reference, value) -> per-token rewards and GAE advantages
    -> clipped policy + value update over shuffled minibatches -> KL control

The maths is in `trainer.losses`; this module is the plumbing. What a run carries from step to step (KL
controller, minibatch order, the micro-batch the update settled on) is `PPOState`, checkpointed.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from foundation.cli import UsageError
from profiling.decode import bandwidth_fraction, bytes_per_decode_step, copy_bandwidth
from trainer.engine.harness import Engine, StepResult
from trainer.engine.metrics import mean_over_ranks
from trainer.losses import (
    gae, kl_penalty, masked_mean, masked_var, masked_whiten, per_token_rewards, ppo_policy_loss, ppo_value_loss,
)
from trainer.rl.kl_control import KLController, make_kl_controller
from trainer.rl.rewards import Scorer
from trainer.rl.rollout import Rollout, Sampling, make_rollout
from trainer.rl.scoring import policy_and_values, trimmed_to_longest_response
from trainer.rl.update import Update, run_update

logger = logging.getLogger(__name__)


@dataclass
class PPOState:
    """What a PPO run carries from step to step; saved in every checkpoint."""

    kl: KLController
    generator: torch.Generator  # minibatch order
    micro_batch_size: int  # the update's micro-batch, halved after an out-of-memory error
    steps_here: int = 0  # steps taken by this process (not saved): the first one meters saved activations
    decode_bound: Optional[tuple[float, int]] = None  # CUDA: (copy bandwidth, bytes read per decode step)

    @classmethod
    def start(cls, args, micro_batch_size: int, seed: int) -> "PPOState":
        return cls(make_kl_controller(args.adaptive_kl, args.init_kl_coef, args.target_kl, args.kl_horizon),
                   torch.Generator().manual_seed(seed), micro_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_controller": self.kl.state_dict(), "minibatch_rng": self.generator.get_state().tolist(),
                "update_micro_batch": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.kl.load_state_dict(state["kl_controller"])
        except ValueError as exc:  # adaptive_kl changed, and --resume_config_check false let it through
            raise UsageError(f"{exc}: resume with the --adaptive_kl setting the checkpoint was saved with") from None
        self.generator.set_state(torch.tensor(state["minibatch_rng"], dtype=torch.uint8))
        self.micro_batch_size = state.get("update_micro_batch", self.micro_batch_size)


@dataclass
class Advantages:
    rewards: torch.Tensor  # (B, R) -beta * kl plus the score on the last token
    non_score_reward: torch.Tensor  # (B, R) -beta * kl
    kl: torch.Tensor  # (B, R) per-token KL estimate
    advantages: torch.Tensor  # (B, R) whitened
    returns: torch.Tensor  # (B, R)


def compute_advantages(rollout: Rollout, beta: float, args) -> Advantages:
    """Per-token rewards (score at the last token, -beta * KL on every token) and whitened GAE advantages."""
    mask = rollout.response_mask
    kl = kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator) * mask
    rewards, non_score = per_token_rewards(rollout.scores, kl, beta, mask)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, rollout.values, mask, args.gamma, args.lam)
    return Advantages(rewards, non_score, kl, masked_whiten(advantages, mask), returns)


def rollout_metrics(rollout: Rollout, adv: Advantages) -> dict[str, float]:
    """TRL-named rollout figures: sums over a response's tokens, means over responses."""
    mask = rollout.response_mask
    non_score = adv.non_score_reward.sum(1)
    return {
        "objective/kl": adv.kl.sum(1).mean().item(),
        "objective/entropy": (rollout.entropy * mask).sum(1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (non_score + rollout.scores).mean().item(),
        "objective/scores": rollout.scores.mean().item(),
        "objective/scores_std": rollout.scores.std().item() if rollout.scores.numel() > 1 else 0.0,
        "val/num_eos_tokens": rollout.ended.float().sum().item(),
        "val/response_length": mask.sum(1).mean().item(),
        "val/returns_mean": masked_mean(adv.returns, mask).item(),
        "val/values_mean": masked_mean(rollout.values, mask).item(),
        "val/values_var": masked_var(rollout.values, mask).item() if mask.sum() > 1 else 0.0,
        **rollout.reward_metrics,
    }


def micro_loss(model, sub: Rollout, advantages: torch.Tensor, returns: torch.Tensor, args, temperature: float):
    """Policy + value loss of one micro-batch, and its detached statistics."""
    ids, att, width = trimmed_to_longest_response(sub.input_ids, sub.attention_mask, sub.response_mask)
    mask, adv, ret = sub.response_mask[:, :width], advantages[:, :width], returns[:, :width]
    logprobs, entropy, values = policy_and_values(model, ids, att, width, temperature)
    pg_loss, pg_stats = ppo_policy_loss(logprobs, sub.logprobs[:, :width], adv, mask, args.cliprange)
    vf_loss, vf_clipfrac = ppo_value_loss(values, sub.values[:, :width], ret, mask, args.cliprange_value)
    entropy = masked_mean(entropy if args.entropy_coef else entropy.detach(), mask)
    loss = pg_loss + args.vf_coef * vf_loss - args.entropy_coef * entropy
    stats = {"loss/policy_avg": pg_loss.detach(), "loss/value_avg": vf_loss.detach(),
             "policy/entropy_avg": entropy.detach(), "policy/approxkl_avg": pg_stats["approxkl"],
             "policy/clipfrac_avg": pg_stats["clipfrac"], "val/clipfrac_avg": vf_clipfrac.detach(),
             "val/ratio": pg_stats["ratio"]}
    return loss, stats


def ppo_update(engine: Engine, rollout: Rollout, adv: Advantages, args, state: PPOState,
               temperature: float) -> tuple[dict[str, float], bool, bool]:
    """`ppo_epochs` passes of shuffled minibatches (`trainer.rl.update`), each micro-batch's loss the clipped
    policy + value loss of one routed pass (`micro_loss`): token means, so micro-batches weigh by tokens."""
    update = Update("PPO", args.ppo_epochs, args.mini_batch_size,
                    loss_of=lambda idx: micro_loss(engine.model, rollout.select(idx), adv.advantages[idx],
                                                   adv.returns[idx], args, temperature),
                    count_of=lambda idx: rollout.response_mask[idx].sum(), grad_norm_key="policy/grad_norm")
    return run_update(engine, state, update, rollout.input_ids.shape[0])


def decode_metrics(model, rollout: Rollout, rows_per_call: int, state: PPOState) -> dict[str, float]:
    """Decoded positions per second of the rollout's generation (prefill included), and on CUDA that
    speed over the bandwidth bound (rows decoded together x copy bandwidth / bytes one step reads;
    the bandwidth is measured once per run by a device copy)."""
    decoded = rollout.input_ids.shape[0] * rollout.response_length
    tokens_per_s = decoded / max(rollout.generate_s, 1e-9)
    out = {"perf/decode_tokens_per_s": tokens_per_s}
    device = rollout.input_ids.device
    if device.type == "cuda":
        if state.decode_bound is None:
            state.decode_bound = (copy_bandwidth(device), sum(bytes_per_decode_step(model).values()))
        bandwidth, step_bytes = state.decode_bound
        rows = min(rows_per_call, rollout.input_ids.shape[0])
        out["perf/decode_bandwidth_fraction"] = bandwidth_fraction(tokens_per_s, rows, step_bytes, bandwidth)
    return out


def ppo_step(engine: Engine, batch: dict[str, torch.Tensor], args, state: PPOState, scorer: Scorer, eos_id: int,
             pad_id: int, phase: Optional[Callable] = None) -> StepResult:
    """Rollout -> advantages -> update -> KL control for one batch of prompts (`args`: PPOArguments).

    `phase(name, **options)` (default: the engine's memory recorder) wraps generate / score / reference /
    value / update, so the recorder, and a benchmark's clock, see each part.
    """
    acc, raw = engine.accelerator, engine.raw
    phase = phase or engine.recorder.phase
    sampling = Sampling.of(args)
    ids, mask = batch["input_ids"].to(acc.device), batch["attention_mask"].to(acc.device)
    started = time.perf_counter()
    # Generation and the no-grad scoring passes go around the DDP / DeepSpeed wrapper (DDP has no
    # generate, and no gradient sync is wanted there); the update goes through it.
    rollout = make_rollout(raw, ids, mask, args, scorer, eos_id, pad_id, phase=phase, examples=batch.get("examples"))
    beta = state.kl.value
    adv = compute_advantages(rollout, beta, args)
    metrics = rollout_metrics(rollout, adv)
    rollout_s = time.perf_counter() - started
    engine.model.train()
    engine.recorder.track(rollout_buffers=[rollout.input_ids, rollout.logprobs, rollout.ref_logprobs, rollout.values,
                                           adv.advantages, adv.returns, adv.rewards])
    lr = engine.scheduler.get_last_lr()[0]
    started = time.perf_counter()
    with phase("update", count_saved=state.steps_here == 0):
        stats, finite, stepped = ppo_update(engine, rollout, adv, args, state, sampling.scoring_temperature)
    state.steps_here += 1
    update_s = time.perf_counter() - started
    engine.recorder.track(rollout_buffers=[])
    # The controller sees the KL averaged over ranks: every rank keeps the same beta (and a NaN KL
    # would make it NaN for good: such a step leaves it alone).
    kl = mean_over_ranks(acc, {"kl": metrics["objective/kl"]})["kl"]
    if math.isfinite(kl):
        state.kl.update(kl, args.rollout_batch_size * acc.num_processes)
    new_tokens = rollout.response_mask.sum().item()
    update_tokens = rollout.attention_mask.sum().item() * args.ppo_epochs
    metrics.update(stats)
    metrics.update(decode_metrics(raw, rollout, args.rollout_micro_batch_size, state))
    metrics.update({"objective/kl_coef": beta, "lr": lr, "perf/rollout_s": rollout_s, "perf/update_s": update_s,
                    "perf/generate_tokens_per_s": new_tokens / max(rollout_s, 1e-9),
                    "perf/update_tokens_per_s": update_tokens / max(update_s, 1e-9),
                    "perf/update_micro_batch": float(state.micro_batch_size)})
    return StepResult(metrics, finite=finite, stepped=stepped)
