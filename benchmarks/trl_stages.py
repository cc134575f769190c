"""TRL's side of `benchmarks.stages_vs_trl`: SFTTrainer, RewardTrainer and DPOTrainer (trl 1.12) on our rows.

Each is TRL's own class and loop, doing our work: our tokenized rows in our order through a sequential
sampler (already within `max_length` and ending in EOS, so TRL adds nothing), the same base with a PEFT
LoRA of our shape (reward: SEQ_CLS, so its `score` head trains like ours), our AdamW and schedule objects
set before `train()`, and for reward a distinct pad token so TRL reads the score at EOS as ours does.
A callback times each optimizer step (TRL's whole loop); a wrapped collator records the rows trained on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from benchmarks.workload import lora_targets

logger = logging.getLogger(__name__)
REWARD_PAD = "<|endoftext|>"  # a token hh-rlhf text does not contain; SmolLM2's pad is its EOS


def dataset_rows(stage: str, rows: Sequence) -> list[dict]:
    """Our examples in the pre-tokenized columns each TRL trainer reads."""
    if stage == "sft":
        return [{"input_ids": e.prompt_ids + e.completion_ids,
                 "completion_mask": [0] * len(e.prompt_ids) + [1] * len(e.completion_ids)} for e in rows]
    if stage == "reward":
        return [{"chosen_ids": e.prompt_ids + e.chosen_ids, "rejected_ids": e.prompt_ids + e.rejected_ids} for e in rows]
    return [{"prompt_ids": e.prompt_ids, "chosen_ids": e.chosen_ids, "rejected_ids": e.rejected_ids} for e in rows]


def feature_rows(stage: str, features: Sequence[dict]) -> list[list[int]]:
    """The token rows of one TRL micro-batch, laid out as our collators lay them (chosen over rejected)."""
    if stage == "sft":
        return [list(f["input_ids"]) for f in features]
    head = [list(f["prompt_ids"]) if stage == "dpo" else [] for f in features]
    return ([h + list(f["chosen_ids"]) for h, f in zip(head, features)]
            + [h + list(f["rejected_ids"]) for h, f in zip(head, features)])


def describe(w) -> dict:
    targets = ",".join(lora_targets(w.model.lora_target_modules))
    common = {"optimizer": "our AdamW object (betas 0.9/0.999, eps 1e-8) and warmup-cosine schedule, set on the "
                           f"Trainer; max_grad_norm {w.train.max_grad_norm}",
              "lora": f"PEFT LoRA via peft_config: r={w.model.lora_r}, alpha={w.model.lora_alpha}, "
                      f"dropout={w.model.lora_dropout}, {targets}",
              "data": "our rows, pre-tokenized, in our order (sequential sampler)"}
    return {"sft": {**common, "class": "trl.SFTTrainer", "loss": "completion_only_loss=True, TRL's default "
                    "loss_type (chunked_nll: head and NLL on label tokens only)"},
            "reward": {**common, "class": "trl.RewardTrainer", "model": "AutoModelForSequenceClassification "
                       "(num_labels=1), score head trained (LoRA task_type SEQ_CLS)",
                       "loss": "-log sigmoid(r_chosen - r_rejected), one stacked forward"},
            "dpo": {**common, "class": "trl.DPOTrainer (_prepare_dataset keeps our token ids)",
                    "reference": "the base model: the policy with its adapter disabled (peft_config)",
                    "loss": f"sigmoid, beta {w.bench.beta}; chosen and rejected in one concatenated forward"}}[w.stage]


def load_model(w, vocab_size: int, device: torch.device):
    """The base as TRL wants it: a causal LM (SFT, DPO) or a sequence classifier with one label (reward),
    whose `score` starts as our scalar head does (normal, std 1/sqrt(hidden + 1))."""
    from benchmarks.trl_ppo import load_score_model
    from benchmarks.workload import head_weights
    from profiling.shapes import load_shape
    from trainer.model.loading import load_base_model

    if w.stage != "reward":
        return load_base_model(w.model, vocab_size=vocab_size, device=device, checkpointing=False)
    hidden = load_shape(w.model.model_name_or_path, vocab_size, w.model.preset_overrides).hidden_size
    model, _ = load_score_model(w.model, vocab_size, device, head=head_weights(hidden, w.train.seed)["reward"])
    return model  # frozen: PEFT trains the LoRA weights and a copy of `score` (modules_to_save)


def run_trl(w, rows: Sequence, tokenizer, device: torch.device, out_dir: Path, result: dict) -> None:
    """Train TRL's trainer on `rows`; fill `result` (steps, trace, adapter) in place."""
    import datasets
    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from trainer.engine.optim import build_optimizer, cosine_with_warmup

    train = w.train
    model = load_model(w, len(tokenizer), device)
    if w.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_config = LoraConfig(r=w.model.lora_r, lora_alpha=w.model.lora_alpha, lora_dropout=w.model.lora_dropout,
                             target_modules=lora_targets(w.model.lora_target_modules), bias="none",
                             task_type="SEQ_CLS" if w.stage == "reward" else "CAUSAL_LM")
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    common = dict(output_dir=str(out_dir / "trl-run"), report_to="none", save_strategy="no", eval_strategy="no",
                  logging_steps=1, disable_tqdm=True, seed=train.seed, data_seed=train.seed, use_cpu=device.type == "cpu",
                  bf16=bf16, fp16=False, max_steps=train.max_steps, per_device_train_batch_size=train.micro_batch_size,
                  gradient_accumulation_steps=train.gradient_accumulation_steps, learning_rate=train.learning_rate,
                  weight_decay=train.weight_decay, max_grad_norm=train.max_grad_norm,
                  activation_checkpointing=w.model.gradient_checkpointing, train_sampling_strategy="sequential",
                  dataloader_num_workers=0, remove_unused_columns=True, max_length=w.data.max_length)
    data = datasets.Dataset.from_list(dataset_rows(w.stage, rows))
    if w.stage == "sft":
        config = trl.SFTConfig(**common, completion_only_loss=True, packing=False, padding_free=False)
        trainer_cls = trl.SFTTrainer
    elif w.stage == "reward":
        config = trl.RewardConfig(**common, pad_token=REWARD_PAD)
        trainer_cls = trl.RewardTrainer
    else:
        config = trl.DPOConfig(**common, beta=w.bench.beta, loss_type=["sigmoid"])
        trainer_cls = _dpo_on_token_ids()
    steps = result["steps"]
    marks = {"wall": 0.0, "cpu": 0.0}

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            marks.update(wall=time.perf_counter(), cpu=time.process_time())

        def on_step_end(self, *_a, **_k):
            now, cpu_now = time.perf_counter(), time.process_time()
            steps.append({"step": len(steps) + 1, "wall_s": now - marks["wall"], "cpu_s": cpu_now - marks["cpu"]})
            marks.update(wall=now, cpu=cpu_now)
            if len(steps) % 10 == 0 or len(steps) == train.max_steps:
                logger.info("trl step %d/%d: %.2f s", len(steps), train.max_steps, steps[-1]["wall_s"])

    trainer = trainer_cls(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                          peft_config=peft_config, callbacks=[StepTimes()])
    trainer.remove_callback(PrinterCallback)
    if len(trainer.train_dataset) != len(rows):
        raise RuntimeError(f"TRL kept {len(trainer.train_dataset)} of the {len(rows)} rows it was given")
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.optimizer = build_optimizer(params, train.optimizer, train.learning_rate, train.weight_decay, device)
    trainer.lr_scheduler = cosine_with_warmup(trainer.optimizer, train.warmup_steps, train.max_steps, train.min_lr_ratio)
    trace = result["trace"] = []
    collate = trainer.data_collator

    def traced(features):
        from benchmarks.row_trace import row_hash

        trace.append([row_hash(r) for r in feature_rows(w.stage, features)])
        return collate(features)

    trainer.data_collator = traced
    if train.profile_memory:
        profile_tensors(trainer, train.gradient_accumulation_steps, device, result)
    result["setup"] = {**describe(w), "trainable_parameters": sum(p.numel() for p in params)}
    trainer.train()
    result["trl_logs"] = [h for h in trainer.state.log_history if "loss" in h][-3:]
    adapter = out_dir / "adapter"
    trainer.save_model(str(out_dir / "trl-adapter"))
    to_our_adapter(w, out_dir / "trl-adapter", adapter)
    result["adapter"] = str(adapter)


def profile_tensors(trainer, accumulation: int, device: torch.device, result: dict) -> None:
    """What ours' `--profile_memory true` records, taken the same way inside TRL's loop: the bytes autograd saves
    for backward over the first optimizer step's micro-batches (`SavedTensorMeter`, the weights excluded), and the
    tensors alive by component (base, adapter, gradients, optimizer states) after the second step's backward, when
    gradients and AdamW states both exist, as in the largest of ours' forward_backward phases. Filled into
    `result["memory"]` as `profiling.recorder` writes ours (bytes)."""
    from contextlib import nullcontext

    from profiling.saved import SavedTensorMeter
    from profiling.tensors import count_tensors

    inner, calls, meter = trainer.training_step, 0, None

    def training_step(*args, **kwargs):
        nonlocal calls, meter
        calls += 1
        if meter is None:  # the weights exist now: what autograd saves of them is not activation memory
            meter = SavedTensorMeter(exclude=count_tensors(trainer.model, trainer.optimizer).storage_keys())
        with meter.watch() if calls <= accumulation else nullcontext():
            loss = inner(*args, **kwargs)
        if calls in (accumulation, 2 * accumulation):  # gradients alive: before the optimizer step
            resident = count_tensors(trainer.model, trainer.optimizer).components(str(device))
            result["memory"] = {"resident": resident, "saved_for_backward": meter.bytes,
                                "after_step": calls // accumulation}
        return loss

    trainer.training_step = training_step


def _dpo_on_token_ids():
    """DPOTrainer reading our `prompt_ids` / `chosen_ids` / `rejected_ids` as they are (its own
    `_prepare_dataset` tokenizes text only; its collator reads exactly these columns)."""
    import trl

    class DPOOnTokenIds(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, *_args, **_kwargs):
            return dataset

    return DPOOnTokenIds


def to_our_adapter(w, trl_dir: Path, out: Path) -> None:
    """TRL's saved adapter as our stages save one, so `trainer.evaluate` scores it like ours.

    SFT / DPO: PEFT's files as they are. Reward: the LoRA weights without `score` (a causal-LM adapter,
    as ours is) and `score` as our scalar head's `head.safetensors` (bias 0: TRL's score has none).
    Beside them: base_model.json (how to rebuild the base), and config.json one level up, whose data
    section names the held-out split."""
    import json
    import shutil
    from dataclasses import asdict

    from safetensors.torch import load_file, save_file

    from trainer.model.adapter_fit import BASE_MODEL_FILE, HEAD_FILE

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((trl_dir / "adapter_config.json").read_text())
    weights = load_file(str(trl_dir / "adapter_model.safetensors"))
    if w.stage == "reward":
        score = weights.pop("base_model.model.score.weight")
        save_file({"linear.weight": score.float().reshape(1, -1).contiguous(), "linear.bias": torch.zeros(1)},
                  str(out / HEAD_FILE))
        config.update(task_type="CAUSAL_LM", modules_to_save=None)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    (out / BASE_MODEL_FILE).write_text(json.dumps(asdict(w.model), indent=2))
    run_config = {"model": asdict(w.model), "data": asdict(w.data), "train": asdict(w.train),
                  "stage": {"beta": w.bench.beta, "sft_adapter": None} if w.stage == "dpo" else {}}
    (out.parent / "config.json").write_text(json.dumps(run_config, indent=2))
    shutil.rmtree(trl_dir, ignore_errors=True)
