"""Stage 3, PPO on ONE shared 4-bit base: policy, reference, value and reward are LoRA adapters.

Each step: sample responses to a batch of prompts with `policy`, score them with `reward`, take
per-token KL against `reference` (the frozen SFT adapter) and values from `value`, compute GAE
advantages, then run clipped policy and value updates over shuffled minibatches.

    accelerate launch trainer/ppo.py --config trainer/configs/ppo.yaml [--field value ...]
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import torch

from trainer.checkpoint import save_checkpoint
from trainer.collators import PromptCollator
from trainer.kl_control import make_kl_controller
from trainer.launch import RowTrace, describe_engine, fill_deepspeed_autos, is_deepspeed
from trainer.loop import (
    MetricsLog, all_finite, batch_stream, finish_trackers, flat_config, make_loader, make_recorder, peak_memory_gb,
)
from trainer.optim import build_loop_optimizer, schedule_for
from trainer.ppo_step import UpdateConfig, compute_advantages, ppo_update, rollout_metrics
from trainer.rollout import RewardModelScorer, SamplingConfig, ScriptedScorer, make_rollout, sample_responses
from trainer.run import RunContext, check_adapter_paths, finish_stage, start_run
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import PromptExample, tokenize_prompts

logger = logging.getLogger(__name__)


@dataclass
class PPOArguments:
    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    reward_adapter: Optional[str] = field(default=None, metadata={"help": "Reward adapter + head (frozen scorer; value start)."})
    scripted_reward: Optional[str] = field(default=None, metadata={"help": "Instead of a reward model: keyword:WORD, length:N or chars:N."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Prompts per PPO step on each process."})
    rollout_micro_batch_size: int = field(default=8, metadata={"help": "Rows per generation / scoring pass."})
    mini_batch_size: int = field(default=4, metadata={"help": "Rows per optimizer step in the update."})
    ppo_epochs: int = field(default=2, metadata={"help": "Passes over each rollout batch."})
    max_new_tokens: int = field(default=32, metadata={"help": "Response length limit."})
    min_new_tokens: int = field(default=0, metadata={"help": "Fix the response length (= max_new_tokens) for benchmarks."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    kl_estimator: str = field(default="k1", metadata={"help": "'k1' (log-ratio) or 'k3' (unbiased, non-negative)."})
    init_kl_coef: float = field(default=0.05, metadata={"help": "KL penalty beta (initial, if adaptive)."})
    adaptive_kl: bool = field(default=False, metadata={"help": "Adapt beta toward target_kl (Ziegler et al.)."})
    target_kl: float = field(default=6.0, metadata={"help": "Target KL per response for the adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Adaptive controller horizon (rollouts)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip around the rollout values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss weight."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus weight."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards before GAE."})
    missing_eos_penalty: Optional[float] = field(default=None, metadata={"help": "Subtracted from scores of responses without EOS."})
    eval_prompts: int = field(default=16, metadata={"help": "Held-out prompts for policy-vs-SFT evaluation."})
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of evaluations (same samples each time)."})
    train_missing_stages: bool = field(
        default=False, metadata={"help": "If sft_adapter / reward_adapter (.../STAGE/adapter) do not exist yet, "
                                 "train them first with trainer/configs/STAGE.yaml (end to end from the base model)."})


class PPOTrainer:
    """The PPO loop: rollout -> advantages -> update, with evaluation, checkpoints and logs."""

    def __init__(self, ctx: RunContext, model, train_prompts: Sequence[PromptExample],
                 eval_prompts: Sequence[PromptExample]):
        self.ctx, self.args, self.targs = ctx, ctx.stage_args, ctx.train_args
        self.accelerator, self.model = ctx.accelerator, model
        tok = ctx.tokenizer
        self.eos_id, self.pad_id = tok.eos_token_id, tok.pad_token_id
        self.collate = PromptCollator(tok.pad_token_id)
        self.train_prompts, self.eval_prompts = train_prompts, eval_prompts
        self.scorer = ScriptedScorer(self.args.scripted_reward, tok) if self.args.scripted_reward else RewardModelScorer()
        a = self.args
        self.sampling = SamplingConfig(a.max_new_tokens, a.min_new_tokens, a.temperature, a.top_k, a.top_p)
        self.update_cfg = UpdateConfig(a.ppo_epochs, a.mini_batch_size, self.targs.micro_batch_size, a.cliprange,
                                       a.cliprange_value, a.vf_coef, a.entropy_coef, self.targs.max_grad_norm,
                                       a.temperature or 1.0)
        self.kl_ctl = make_kl_controller(a.adaptive_kl, a.init_kl_coef, a.target_kl, a.kl_horizon)
        truncating = [f"{k}={v}" for k, v, off in (("top_k", a.top_k, 0), ("top_p", a.top_p, 1.0),
                                                   ("min_new_tokens", a.min_new_tokens, 0)) if v != off]
        if truncating:
            logger.warning("PPO scores the untruncated policy at temperature %s (as TRL does), while %s reshape the "
                           "distribution responses are sampled from: ratios and KL are then approximate",
                           a.temperature, ", ".join(truncating))

    def train(self) -> dict[str, float]:
        acc, targs, args = self.accelerator, self.targs, self.args
        out_dir = Path(targs.output_dir)
        params = self.model.trainable_parameters()
        optimizer = build_loop_optimizer(params, targs, acc)
        loader, sampler = make_loader(self.train_prompts, self.collate, args.rollout_batch_size, targs.seed)
        if is_deepspeed(acc):  # the engine fixes its accumulation at prepare: one step per PPO minibatch
            acc.gradient_accumulation_steps = args.mini_batch_size // targs.micro_batch_size
        fill_deepspeed_autos(acc, self.model, targs.max_grad_norm)
        model, optimizer, loader = acc.prepare(self.model, optimizer, loader)
        scheduler = schedule_for(model, optimizer, targs)
        # Generation and the no-grad scoring passes go around the DDP / engine wrapper (DDP has no
        # generate, and no gradient sync is wanted there); the update goes through it.
        raw = acc.unwrap_model(model)
        if is_deepspeed(acc) and acc.is_main_process:
            logger.info(describe_engine(model))
        recorder = make_recorder("ppo", self.model, optimizer, targs, acc)
        generator = torch.Generator().manual_seed(targs.seed)  # minibatch order, saved with the checkpoint
        metrics_log = MetricsLog(acc, out_dir)
        state = {"epoch": 0, "batches_in_epoch": 0}
        start = 0
        if (path := self.ctx.resume_from) is not None:
            from trainer.checkpoint import load_checkpoint

            state.update(load_checkpoint(acc, path, model, ["policy", "value"], optimizer, scheduler))
            start = state.pop("step")
            self.kl_ctl.load_state_dict(state.pop("kl_controller"))
            generator.set_state(torch.tensor(state.pop("minibatch_rng"), dtype=torch.uint8))
            metrics_log.truncate_after(start)
        elif acc.is_main_process and metrics_log.path.exists():
            metrics_log.path.unlink()
        if targs.report_to == "tensorboard":
            acc.init_trackers("ppo", config=flat_config(self.ctx.config()))
        if start == 0:
            self._log_eval(raw, metrics_log, 0)
        stream = batch_stream(acc, loader, sampler, state["epoch"], state["batches_in_epoch"])
        trace = RowTrace(acc)
        micro = self.update_cfg.micro_batch_size
        for step in range(start + 1, targs.max_steps + 1):
            state["epoch"], state["batches_in_epoch"], batch = next(stream)
            trace.record(step, batch)
            t0 = time.perf_counter()
            raw.eval()
            rollout = make_rollout(raw, batch["input_ids"], batch["attention_mask"], self.sampling, self.scorer,
                                   self.eos_id, self.pad_id, args.rollout_micro_batch_size, args.missing_eos_penalty,
                                   phase=recorder.phase)
            t_rollout = time.perf_counter() - t0
            adv = compute_advantages(rollout, self.kl_ctl.value, args.kl_estimator, args.gamma, args.lam,
                                     args.whiten_rewards)
            metrics = rollout_metrics(rollout, adv)
            model.train()
            t1 = time.perf_counter()
            self.update_cfg.micro_batch_size = micro
            recorder.track(rollout_buffers=[rollout.input_ids, rollout.logprobs, rollout.ref_logprobs, rollout.values,
                                            adv.advantages, adv.returns, adv.rewards])
            with recorder.phase("update", count_saved=step == start + 1):
                update_stats, micro = ppo_update(model, acc, optimizer, params, rollout, adv, self.update_cfg,
                                                 generator, on_gradients=recorder.sample)
            recorder.track(rollout_buffers=[])
            t_update = time.perf_counter() - t1
            scheduler.step()
            new_tokens = rollout.response_mask.sum().item()
            seen_tokens = rollout.attention_mask.sum().item() * args.ppo_epochs
            peak, kind = peak_memory_gb(acc.device)
            metrics.update(update_stats)
            metrics.update({"objective/kl_coef": self.kl_ctl.value, "lr": scheduler.get_last_lr()[0],
                            "perf/rollout_s": t_rollout, "perf/update_s": t_update,
                            "perf/generate_tokens_per_s": new_tokens / max(t_rollout, 1e-9),
                            "perf/update_tokens_per_s": seen_tokens / max(t_update, 1e-9),
                            "perf/update_micro_batch": float(micro), f"perf/peak_{kind}_gb": peak})
            metrics = _mean_over_ranks(acc, metrics)
            # After averaging: every rank's controller sees the same KL, so beta stays one value.
            self.kl_ctl.update(metrics["objective/kl"], args.rollout_batch_size * acc.num_processes)
            if not all_finite(acc, torch.tensor(metrics["loss/policy_avg"])):
                raise RuntimeError(f"PPO step {step}: the policy loss is not finite; lower the learning rate")
            metrics_log.write(step, metrics)
            if acc.is_main_process and (step % targs.log_every == 0 or step == targs.max_steps):
                logger.info("step %d/%d | score %.3f | kl %.3f | beta %.4f | clipfrac %.3f | len %.1f | "
                            "rollout %.1fs (%.0f tok/s) | update %.1fs | peak %.2f GB", step, targs.max_steps,
                            metrics["objective/scores"], metrics["objective/kl"], metrics["objective/kl_coef"],
                            metrics["policy/clipfrac_avg"], metrics["val/response_length"], t_rollout,
                            metrics["perf/generate_tokens_per_s"], t_update, peak)
            if step == targs.max_steps or (targs.eval_every and step % targs.eval_every == 0):
                self._log_eval(raw, metrics_log, step)
            if targs.save_every and (step % targs.save_every == 0 or step == targs.max_steps):
                extra = {**state, "kl_controller": self.kl_ctl.state_dict(),
                         "minibatch_rng": generator.get_state().tolist()}
                save_checkpoint(acc, out_dir, step, model, ["policy", "value"], optimizer, scheduler, extra,
                                targs.keep_checkpoints, self.ctx.config())
        if micro != targs.micro_batch_size:
            logger.warning("the update settled on micro-batch %d (asked for %d) after running out of memory",
                           micro, targs.micro_batch_size)
        recorder.write(out_dir, config=flat_config(self.ctx.config()))
        finish_trackers(acc)
        return {"update_micro_batch": micro}

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        """Policy vs SFT (the reference adapter) on held-out prompts, scored by the same scorer."""
        if not self.eval_prompts:
            return {}
        acc = self.accelerator
        mine = self.eval_prompts[acc.process_index :: acc.num_processes]
        model.eval()
        results: dict[str, list[torch.Tensor]] = {"policy": [], "sft": [], "kl": [], "len_policy": [], "len_sft": []}
        with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []):
            for i in range(0, len(mine), self.args.rollout_micro_batch_size):
                batch = self.collate(mine[i : i + self.args.rollout_micro_batch_size])
                ids, mask = batch["input_ids"].to(acc.device), batch["attention_mask"].to(acc.device)
                for name, adapter in (("policy", "policy"), ("sft", "reference")):
                    torch.manual_seed(self.args.eval_seed + i)
                    full, att, rmask, _ = sample_responses(model, ids, mask, self.sampling, self.eos_id, self.pad_id,
                                                           adapter=adapter)
                    results[name].append(self.scorer(model, full, att, ids.shape[1], rmask).float())
                    results[f"len_{name}"].append(rmask.sum(1).float())
                    if name == "policy":
                        from trainer.rollout import response_logprobs

                        temperature = self.sampling.temperature or 1.0  # the distribution sampled from
                        lp, _ = response_logprobs(model, full, att, ids.shape[1], "policy", temperature=temperature)
                        ref, _ = response_logprobs(model, full, att, ids.shape[1], "reference", temperature=temperature)
                        results["kl"].append(((lp - ref) * rmask).sum(1))
        from accelerate.utils import gather_object

        merged = {k: torch.tensor(gather_object(torch.cat(v).tolist())) for k, v in results.items()}
        return {"score_policy": merged["policy"].mean().item(), "score_sft": merged["sft"].mean().item(),
                "win_rate": ((merged["policy"] > merged["sft"]).float() + 0.5 * (merged["policy"] == merged["sft"]).float()).mean().item(),
                "kl": merged["kl"].mean().item(), "response_length_policy": merged["len_policy"].mean().item(),
                "response_length_sft": merged["len_sft"].mean().item(), "prompts": float(merged["policy"].numel())}

    def _log_eval(self, model, metrics_log: MetricsLog, step: int) -> None:
        results = self.evaluate(model)
        if results:
            metrics_log.write(step, {f"eval/{k}": v for k, v in results.items()})
            logger.info("eval at step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in results.items()))


def _mean_over_ranks(acc, metrics: dict[str, float]) -> dict[str, float]:
    keys = sorted(metrics)
    t = acc.reduce(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=acc.device), "mean")
    return dict(zip(keys, t.tolist()))


def adapter_specs(args: PPOArguments) -> list[AdapterSpec]:
    """policy + reference from the SFT adapter; value (+ head) from the reward adapter; reward frozen."""
    check_adapter_paths(args)
    if args.reward_adapter is None and args.scripted_reward is None:
        raise SystemExit("PPO needs a scorer: pass --reward_adapter DIR (from trainer/reward.py) or "
                         "--scripted_reward keyword:WORD|length:N")
    specs = [AdapterSpec("policy", trainable=True, init_from=args.sft_adapter),
             AdapterSpec("reference", trainable=False, init_from=args.sft_adapter),
             AdapterSpec("value", trainable=True, init_from=args.reward_adapter, head=True)]
    if args.reward_adapter is not None:
        specs.append(AdapterSpec("reward", trainable=False, init_from=args.reward_adapter, head=True))
    return specs


def check_batch_sizes(args: PPOArguments, micro: int) -> None:
    if args.rollout_batch_size % args.mini_batch_size or args.mini_batch_size % micro:
        raise SystemExit(f"rollout_batch_size ({args.rollout_batch_size}) must be a multiple of mini_batch_size "
                         f"({args.mini_batch_size}), and that a multiple of micro_batch_size ({micro})")


def train_missing_stages(argv: Optional[list[str]]) -> None:
    """Produce absent SFT / reward adapters with the stage configs, so the default PPO config runs
    end to end on a fresh checkout."""
    import sys

    from trainer.config import DataArguments, ModelArguments, TrainArguments, parse_config
    from trainer.pipeline import CONFIG_ROOT, reset_accelerate

    argv = list(sys.argv[1:] if argv is None else argv)
    model_args, _, _, args = parse_config((ModelArguments, DataArguments, TrainArguments, PPOArguments), argv)
    if not args.train_missing_stages:
        return
    from trainer import reward, sft

    # The stage configs beside the PPO config (a recipe folder), else the demo ones.
    folder = Path(argv[argv.index("--config") + 1]).parent if "--config" in argv else CONFIG_ROOT
    if not (folder / "sft.yaml").is_file() or not (folder / "reward.yaml").is_file():
        folder = CONFIG_ROOT

    for name, path, entry, links in (("sft", args.sft_adapter, sft.main, []),
                                     ("reward", args.reward_adapter, reward.main, ["--sft_adapter", args.sft_adapter])):
        if path is None or (Path(path) / "adapter_config.json").is_file():
            continue
        if Path(path).name != "adapter" or None in links:
            raise SystemExit(f"--{name}_adapter {path} is missing and is not a STAGE_DIR/adapter path to train into")
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logger.info("%s adapter %s is missing: training it first with %s", name, path, folder / f"{name}.yaml")
        reset_accelerate()
        entry(["--config", str(folder / f"{name}.yaml"), "--output_dir", str(Path(path).parent),
               "--model_name_or_path", model_args.model_name_or_path, *links])
        reset_accelerate()


def build_model(ctx: RunContext):
    """The four adapters on one base, with LoRA dropout off: rollout log-probs are taken in eval mode, so
    dropout in the update would make the first policy ratio differ from 1."""
    model_args = ctx.model_args
    if model_args.lora_dropout:
        logger.info("PPO trains without LoRA dropout: lora_dropout %s -> 0", model_args.lora_dropout)
        model_args = replace(model_args, lora_dropout=0.0)
    return build_shared_model(model_args, adapter_specs(ctx.stage_args), vocab_size=len(ctx.tokenizer),
                              device=ctx.accelerator.device)


def main(argv: Optional[list[str]] = None) -> dict:
    train_missing_stages(argv)
    ctx = start_run(PPOArguments, argv, stage="ppo")
    args = ctx.stage_args
    check_batch_sizes(args, ctx.train_args.micro_batch_size)
    adapter_specs(args)  # a missing scorer stops the run before the data is tokenized
    prompts, _ = tokenize_prompts(ctx.splits.ppo, ctx.tokenizer, ctx.data_args)
    held_out, _ = tokenize_prompts(ctx.splits.eval[: args.eval_prompts], ctx.tokenizer, ctx.data_args)
    model = build_model(ctx)
    trainer = PPOTrainer(ctx, model, prompts, held_out)
    summary = trainer.train()
    return finish_stage(ctx, "ppo", model, "policy", prompts=len(prompts), **summary)


if __name__ == "__main__":
    main()
