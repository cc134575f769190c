"""Our side: the PPO step of trainer/ppo.py on ONE base carrying four LoRA adapters.

Timed per step, exactly the calls `PPOTrainer.train` makes (without its evaluation, logging and
checkpoints): rollout = `make_rollout` (generate with `policy`; score with `policy`, `reward`,
`reference`, `value`) + `compute_advantages`; update = `ppo_update` (clipped policy + value loss,
accumulation, clipping, optimizer steps) + `rollout_metrics`.
"""

from __future__ import annotations

import logging

import torch

from benchmarks.measure import MemoryProbe, PhaseClock, StepCounter, step_record
from benchmarks.workload import BenchArguments

logger = logging.getLogger(__name__)


def describe(args: BenchArguments, four_bit: bool, optimizer_name: str) -> dict:
    base = "4-bit NF4 (double quant)" if four_bit else "full precision"
    return {
        "models": f"ONE {args.model_name_or_path} base ({base}), frozen, loaded once",
        "policy": f"LoRA adapter 'policy' (trainable; r={args.lora_r}, alpha={args.lora_alpha}, "
                  f"{args.lora_target_modules})",
        "reference": "LoRA adapter 'reference' on the same base (frozen; fresh, so equal to the base)",
        "value": "LoRA adapter 'value' + scalar head (trainable) on the same base",
        "reward": "LoRA adapter 'reward' + scalar head (frozen; fresh adapter, shared head weights) on the same base",
        "optimizer": optimizer_name,
        "gradient_checkpointing": args.gradient_checkpointing,
        "scoring": "policy / reward / reference / value passes compute only the response positions' outputs",
    }


def build_model(args: BenchArguments, vocab_size: int, device: torch.device, head_dirs: dict[str, str]):
    """ONE base with policy, reference, value (+ head) and reward (+ head) adapters; the heads from files."""
    from trainer.shared_base import AdapterSpec, build_shared_model

    specs = [AdapterSpec("policy", trainable=True), AdapterSpec("reference"),
             AdapterSpec("value", trainable=True, head=True, head_from=head_dirs["value"]),
             AdapterSpec("reward", head=True, head_from=head_dirs["reward"])]
    return build_shared_model(args.model_arguments(), specs, vocab_size=vocab_size, device=device)


def run_ours(args: BenchArguments, prompts: list[list[int]], tokenizer, accelerator, probe: MemoryProbe,
             head_dirs: dict[str, str], result: dict) -> None:
    """Fill `result` (setup, steps) in place, so a failure part-way keeps what was measured."""
    from trainer.collators import PromptCollator
    from trainer.models import resolve_quantization
    from trainer.optim import build_optimizer, resolve_optimizer_name
    from trainer.ppo_step import UpdateConfig, compute_advantages, ppo_update, rollout_metrics
    from trainer.rollout import RewardModelScorer, SamplingConfig, make_rollout

    device = accelerator.device
    model_args = args.model_arguments()
    clock = PhaseClock(probe)
    clock.start()
    model = build_model(args, len(tokenizer), device, head_dirs)
    params = model.trainable_parameters()
    optimizer_name = resolve_optimizer_name(args.optimizer, device)
    optimizer = build_optimizer(params, optimizer_name, args.learning_rate, 0.0, device)
    model, optimizer = accelerator.prepare(model, optimizer)
    setup = clock.lap()
    result["setup"] = describe(args, resolve_quantization(model_args.quantization, device), optimizer_name)
    result["setup"]["trainable_parameters"] = sum(p.numel() for p in params)
    result.update(setup_s=setup.seconds, setup_peak=setup.peaks, resident_after_setup=probe.now())

    collate = PromptCollator(tokenizer.pad_token_id)
    sampling = SamplingConfig(args.max_new_tokens, args.max_new_tokens, args.temperature, 0, 1.0)
    update_cfg = UpdateConfig(args.ppo_epochs, args.mini_batch_size, args.micro_batch_size, args.cliprange,
                              args.cliprange_value, args.vf_coef, 0.0, args.max_grad_norm, args.temperature or 1.0)
    scorer = RewardModelScorer()
    generator = torch.Generator().manual_seed(args.seed)
    counter = StepCounter(optimizer)
    b = args.rollout_batch_size
    try:
        for i in range(args.total_steps):
            batch = collate_rows(collate, prompts[i * b : (i + 1) * b])
            clock.start()
            model.eval()
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            rollout = make_rollout(model, ids, mask, sampling, scorer, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                   args.rollout_micro_batch_size, None, phase=clock.subphase)
            adv = compute_advantages(rollout, args.kl_coef, args.kl_estimator, args.gamma, args.lam)
            rollout_lap = clock.lap()
            model.train()
            stats, micro = ppo_update(model, accelerator, optimizer, params, rollout, adv, update_cfg, generator)
            update_cfg.micro_batch_size = micro
            metrics = {**rollout_metrics(rollout, adv), **stats}
            update_lap = clock.lap()
            result["steps"].append(step_record(
                i + 1, i < args.warmup_steps, rollout_lap, update_lap, clock.parts, optimizer_steps=counter.take(),
                response_tokens=int(rollout.response_mask.sum().item()), update_micro_batch=micro))
            result["metrics"] = {k: float(v) for k, v in metrics.items()}
            logger.info("ours step %d: rollout %.2fs, update %.2fs", i + 1, rollout_lap.seconds, update_lap.seconds)
    finally:
        counter.remove()
        accelerator.free_memory()  # drops accelerate's references to the model and optimizer


def collate_rows(collate, rows: list[list[int]]) -> dict[str, torch.Tensor]:
    from trainer.tokenization import PromptExample

    return collate([PromptExample(r, "bench") for r in rows])
