"""TRL's side: `trl.experimental.ppo.PPOTrainer` (trl 1.12.0, the last release with PPO), as light as it goes.

The policy is the base with a PEFT LoRA (`ref_model=None`: the reference pass disables the adapter); value
and reward are separate `AutoModelForSequenceClassification(num_labels=1)` models of the same base (4-bit
where the policy is), the value one with a LoRA and a trainable `score` head, the reward one frozen.
TRL's own `train()` loop is timed from inside without changing it: a callback marks step ends, and wrappers
on `batch_generation` and `forward` time generation and mark where the update starts.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Optional

import torch

from benchmarks.measure import Lap, PhaseClock, StepCounter, step_record
from benchmarks.workload import Workload, trl_batch_settings
from foundation.settings import ModelArguments
from profiling.device import MemoryProbe

logger = logging.getLogger(__name__)


def load_score_model(model_args: ModelArguments, vocab_size: int, device: torch.device, head: torch.Tensor):
    """A frozen AutoModelForSequenceClassification(num_labels=1) of the same base, `score` = `head`."""
    from transformers import AutoModelForSequenceClassification

    from profiling.shapes import PRESETS, preset_config
    from trainer.model.loading import (
        bnb_config, pick_attention, quantize_linears_, resolve_model_path, resolve_precision
    )

    four_bit, dtype = resolve_precision(model_args, device)  # the rule trainer.model.loading.load_base_model uses
    attn = pick_attention(model_args.attn_implementation, device)
    name = model_args.model_name_or_path
    if name in PRESETS:
        config = preset_config(name, vocab_size, model_args.preset_overrides)
        config.num_labels = 1
        torch.manual_seed(model_args.model_seed)  # the same random weights as the causal LM of the preset
        with torch.device(device):
            model = AutoModelForSequenceClassification.from_config(config, dtype=dtype, attn_implementation=attn)
        if four_bit:
            quantize_linears_(model, dtype, device, skip=("score",))
    else:
        kwargs = dict(num_labels=1, dtype=dtype, attn_implementation=attn, use_safetensors=True,
                      trust_remote_code=model_args.trust_remote_code)
        if four_bit:
            quant = bnb_config(dtype)
            quant.llm_int8_skip_modules = ["score"]
            kwargs.update(quantization_config=quant, device_map={"": device})
        model = AutoModelForSequenceClassification.from_pretrained(str(resolve_model_path(name)), **kwargs)
        if not four_bit:
            model.to(device)
    model.requires_grad_(False)
    with torch.no_grad():
        model.score.weight.copy_(head.to(model.score.weight.dtype))
    return model, four_bit


def add_value_lora(model, args: Workload) -> None:
    """LoRA of the policy's shape injected into the value model; LoRA weights and `score` train."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                       target_modules=args.lora_targets(), bias="none"), model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or name.startswith("score."))


def describe(args: Workload, four_bit: bool, optimizer_name: str) -> dict:
    base = "4-bit NF4 (double quant)" if four_bit else "full precision"
    targets = ",".join(args.lora_targets())
    return {
        "models": f"THREE {args.model_name_or_path} models ({base}, frozen bases): policy (causal LM), "
                  "value and reward (AutoModelForSequenceClassification, num_labels=1)",
        "policy": f"causal LM + PEFT LoRA via peft_config (trainable; r={args.lora_r}, alpha={args.lora_alpha}, "
                  f"{targets})",
        "reference": "ref_model=None: the policy with its LoRA adapter disabled (PEFT's disable_adapter)",
        "value": f"sequence-classification model + injected LoRA (r={args.lora_r}, {targets}) and its score "
                 "head (trainable)",
        "reward": "sequence-classification model, frozen, score head = the same weights as our reward head",
        "optimizer": f"{optimizer_name} (PPOConfig.optim), constant LR, no gradient clipping (TRL's PPO loop has none)",
        "gradient_checkpointing": args.gradient_checkpointing,
        "scoring": "reference, value and reward passes compute all positions (full-vocabulary logits of the "
                   "reference); policy log-probs come from the logits kept during generation",
    }


class _Hooks:
    """Step boundaries from a TrainerCallback; rollout/update boundary and generation time from wrappers."""

    def __init__(self, clock: PhaseClock, result: dict, args: Workload):
        self.clock, self.result, self.args = clock, result, args
        self.update_model = None  # TRL's policy-and-value wrapper, once the trainer exists
        self.counter: Optional[StepCounter] = None
        self.in_update = False
        self.rollout: Optional[Lap] = None
        self.last_logs: dict = {}
        self.generated = 0  # response tokens generated in this step, counted from batch_generation's output
        self.step = 0

    def step_begin(self) -> None:
        self.clock.start()
        self.in_update = False
        self.generated = 0

    def update_begin(self) -> None:
        self.rollout = self.clock.lap()
        self.in_update = True

    def step_end(self) -> None:
        update = self.clock.lap()
        self.step += 1
        self.result["steps"].append(step_record(
            self.step, self.step <= self.args.warmup_runs, self.rollout, update, self.clock.parts,
            optimizer_steps=self.counter.take() if self.counter else None, response_tokens=self.generated,
            update_micro_batch=self.args.micro_batch_size))
        self.result["metrics"] = {k: float(v) for k, v in self.last_logs.items() if isinstance(v, (int, float))}
        logger.info("trl step %d: rollout %.2fs, update %.2fs", self.step, self.rollout.seconds, update.seconds)
        self.step_begin()  # what TRL does after a step (empty_cache, gc) counts toward the next one


def run_trl(args: Workload, prompts: list[list[int]], tokenizer, accelerator, probe: MemoryProbe,
            heads: dict[str, torch.Tensor], result: dict, compiled: bool = False) -> None:
    """Fill `result` (setup, steps) in place, so a failure part-way keeps what was measured.

    `compiled`: the three models' decoder layers compiled as --compile_layers compiles ours
    (`trainer.model.compiled.compile_layers`: for the passes that train): what TRL would gain from it. TRL's
    PPO loop compiles nothing itself: its Accelerator gets no dynamo plugin, so `PPOConfig.torch_compile`
    changes nothing there but, on CUDA, turns TF32 on for the whole process (`TrainingArguments`), which
    would skew every side run after it; it is left unset."""
    import datasets
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from peft import LoraConfig
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from trainer.engine.optim import resolve_optimizer_name
    from trainer.model.compiled import compile_layers
    from trainer.model.loading import enable_checkpointing, load_base_model

    device, vocab = accelerator.device, len(tokenizer)
    clock = PhaseClock(probe)
    clock.start()
    policy = load_base_model(args.model, vocab_size=vocab, device=device, checkpointing=False)
    value, four_bit = load_score_model(args.model, vocab, device, heads["value"])
    add_value_lora(value, args)
    reward, _ = load_score_model(args.model, vocab, device, heads["reward"])
    if args.gradient_checkpointing:
        enable_checkpointing(policy)
        enable_checkpointing(value)
    compiled_parts = sum(compile_layers(m) for m in (policy, value, reward)) if compiled else 0
    optimizer_name = resolve_optimizer_name(args.optimizer, device)
    if optimizer_name == "adamw_torch":  # ours runs torch's fused AdamW kernel (trainer.engine.optim.fused_adamw)
        optimizer_name = "adamw_torch_fused"
    hooks = _Hooks(clock, result, args)

    class StepEvents(TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            hooks.step_begin()

        def on_log(self, _args, _state, _control, logs=None, **_k):
            hooks.last_logs = dict(logs or {})

        def on_step_end(self, *_a, **_k):
            hooks.step_end()

    out = tempfile.mkdtemp(prefix="trl-ppo-")
    mixed = accelerator.mixed_precision  # TRL's own Accelerator() shares this process's AcceleratorState
    config = ppo_module.PPOConfig(
        output_dir=out, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed,
        bf16=mixed == "bf16", fp16=mixed == "fp16", use_cpu=device.type == "cpu", optim=optimizer_name,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", weight_decay=0.0,
        gradient_checkpointing=args.gradient_checkpointing, total_episodes=args.total_steps * args.rollout_batch_size,
        response_length=args.max_new_tokens, stop_token=None, temperature=args.temperature,
        kl_coef=args.init_kl_coef, kl_estimator=args.kl_estimator, cliprange=args.cliprange,
        cliprange_value=args.cliprange_value, vf_coef=args.vf_coef, gamma=args.gamma, lam=args.lam,
        num_sample_generations=0, **trl_batch_settings(args))
    peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                             target_modules=args.lora_targets(), bias="none", task_type="CAUSAL_LM")
    dataset = datasets.Dataset.from_dict({"input_ids": prompts})
    trainer = ppo_module.PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
        train_dataset=dataset, value_model=value, data_collator=stack_prompts, eval_dataset=dataset,
        peft_config=peft_config, callbacks=[StepEvents()])
    del policy, value, reward
    trainer.remove_callback(PrinterCallback)  # its per-step dict print; the metrics go into the JSON
    hooks.update_model = trainer.model
    hooks.counter = counter = StepCounter(trainer.optimizer)
    setup = clock.lap()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result["setup"] = {**describe(args, four_bit, optimizer_name), "trainable_parameters": trainable,
                       "compiled decoder layers": (f"{compiled_parts} (trainer.model.compiled.compile_layers on the "
                                                   "three models, for the passes that train: the reward model's only "
                                                   "pass has none, so it runs eagerly)") if compiled else "none",
                       "ppo_config": {k: getattr(getattr(config, k), "value", getattr(config, k)) for k in (
                           *trl_batch_settings(args), "local_batch_size", "local_mini_batch_size", "total_episodes",
                           "num_total_batches", "response_length", "bf16", "optim", "gradient_checkpointing")}}
    result.update(setup_s=setup.seconds, setup_peak=setup.peaks, resident_after_setup=probe.now())

    original_generation, original_forward = ppo_module.batch_generation, ppo_module.forward

    def timed_generation(model, queries, *a, **k):
        with clock.subphase("generate"):
            query_responses, logits = original_generation(model, queries, *a, **k)
        hooks.generated += query_responses.shape[0] * (query_responses.shape[1] - queries.shape[1])
        return query_responses, logits

    def marked_forward(model, *a, **k):
        if model is hooks.update_model and not hooks.in_update:
            hooks.update_begin()
        return original_forward(model, *a, **k)

    ppo_module.batch_generation, ppo_module.forward = timed_generation, marked_forward
    try:
        trainer.train()
    finally:
        ppo_module.batch_generation, ppo_module.forward = original_generation, original_forward
        counter.remove()
        trainer.accelerator.free_memory()
        trainer.model = trainer.optimizer = trainer.ref_model = trainer.reward_model = None
        trainer.value_model = trainer.policy_model = trainer.callback_handler = None
        shutil.rmtree(out, ignore_errors=True)  # save_strategy="no": nothing is written there


def stack_prompts(rows: list[dict]) -> dict[str, torch.Tensor]:
    """TRL's collator: every prompt has the same length, so stacking needs no padding."""
    return {"input_ids": torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)}
