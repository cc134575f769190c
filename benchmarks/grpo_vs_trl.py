"""Our GRPO step against TRL's GRPOTrainer on the same work - TRL's QLoRA GRPO recipe by default.

    python -m benchmarks.grpo_vs_trl --model_name_or_path qwen2.5-7b          # the recipe, on a GPU
    python -m benchmarks.grpo_vs_trl --model_name_or_path tiny-llama --max_new_tokens 8 ...   # a smoke run

Both sides: the same base (NF4 where CUDA has bitsandbytes), LoRA r=32 on every linear layer, no dropout,
paged 8-bit AdamW on CUDA, gradient checkpointing, beta 0 (no reference pass), the same reward function
(`--scripted_reward`, TRL's calling convention), `num_generations` completions of exactly `max_new_tokens`
tokens for each of `rollout_batch_size` hh-rlhf prompts of `prompt_length` tokens (TRL tokenizes the text
again), one optimizer step per generation. Ours is the GRPO stage's own model and step
(`trainer.grpo.build_model`, `trainer.rl.online.rl_step`); TRL's is its `GRPOTrainer.train()`. Each side runs in
a process of its own: `warmup_runs` steps, then `steps` measured; per side the step, rollout and update time,
peak allocated and reserved, and the device's NVML reading. Writes grpo_vs_trl.json / .md into `out_dir`.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.measure import PhaseClock, StepCounter, log_to_stdout, release_memory, side_errors, step_record
from benchmarks.ours import as_the_stage_plans, run_steps
from benchmarks.ppo_vs_trl import summarize
from benchmarks.processes import side_in_own_process
from benchmarks.workload import fixed_length_prompts, load_bench_tokenizer, lora_targets, parse_parts, part_attribute
from foundation.cli import Checked, at_least, run
from foundation.settings import DataArguments, GRPOArguments, ModelArguments, TrainArguments
from profiling.device import MemoryProbe
from profiling.report import table_lines

logger = logging.getLogger("benchmarks.grpo_vs_trl")
ROOT = Path(__file__).resolve().parent.parent
SIDES = {"ours": "ours (one base, GRPO stage)",
         "ours_4bit": "ours, decoding from the 4-bit weights (--generation_weights quantized)",
         "trl": "TRL GRPOTrainer"}
OURS = ("ours", "ours_4bit")
# TRL's QLoRA GRPO recipe (benchmarks/trl_grpo_recipe.py), and a benchmark's fixed-length, log-free run
RECIPE = {"model_name_or_path": "qwen2.5-7b", "lora_r": 32, "lora_alpha": 64, "lora_dropout": 0.0,
          "gradient_checkpointing": True, "beta": 0.0, "num_generations": 8, "rollout_batch_size": 1,
          "mini_batch_size": 8, "micro_batch_size": 8, "rollout_micro_batch_size": 8, "max_new_tokens": 256,
          "scripted_reward": "chars:200", "learning_rate": 1e-5, "warmup_steps": 0, "min_lr_ratio": 1.0,
          "report_to": "none", "progress_bar": False, "eval_prompts": 0, "check_budget": False, "auto_fit": False}


@dataclass
class GRPOBenchArguments(Checked):
    """What this benchmark adds to the training settings."""

    prompt_length: int = field(default=128, metadata={"help": "Every prompt has exactly this many tokens."})
    steps: int = field(default=1, metadata={"help": "Measured steps per side."})
    warmup_runs: int = field(default=1, metadata={"help": "Steps run first and left out of the figures."})
    sides: str = field(default="ours,trl", metadata={
        "help": "Which sides to run, in this order: ours (its settings as the stage plans them), ours_4bit (the "
                "same, decoding from the 4-bit weights: less memory, slower rollouts), trl."})
    isolate: bool = field(default=True, metadata={"help": "Each side in a fresh Python process of its own."})
    out_dir: Optional[str] = field(default=None, metadata={"help": "Default benchmarks/results/grpo_vs_trl-MODEL-DEVICE."})
    side_run_out: Optional[str] = field(default=None, metadata={
        "help": "Internal (what --isolate runs): run the one side of --sides, write its record here, exit."})

    RULES = {"prompt_length": at_least(2), "steps": at_least(1), "warmup_runs": at_least(0),
             "sides": lambda name, value: None if value and set(value.split(",")) <= set(SIDES)
             else f"must be some of {', '.join(SIDES)}, comma-separated"}


@dataclass(frozen=True)
class GRPOWorkload:
    """The settings objects of one run (training's own, with the recipe's values) and the benchmark's."""

    model: ModelArguments
    data: DataArguments
    train: TrainArguments
    grpo: GRPOArguments
    bench: GRPOBenchArguments

    def __getattr__(self, name: str) -> Any:  # w.prompt_length, w.num_generations: the part that has it
        return part_attribute(self, name)

    @classmethod
    def parse(cls, argv: Sequence[str]) -> "GRPOWorkload":
        return cls(*parse_parts(GRPOArguments, GRPOBenchArguments, argv, RECIPE))

    @property
    def total_steps(self) -> int:
        return self.bench.warmup_runs + self.bench.steps

    @property
    def rows(self) -> int:
        return self.grpo.rollout_batch_size * self.grpo.num_generations

    def tokens(self) -> dict[str, int]:
        return {"generated": self.rows * self.grpo.max_new_tokens,
                "update": self.rows * (self.bench.prompt_length + self.grpo.max_new_tokens)}


def run_ours(args: GRPOWorkload, prompts: list[list[int]], tokenizer, accelerator, probe: MemoryProbe,
             result: dict) -> None:
    """The GRPO stage's model, step and state (`trainer.grpo`, `trainer.rl.online`) without its harness, its
    settings left auto planned as the stage plans them (`ours_4bit`: decoding from the 4-bit weights)."""
    if result["side"] == "ours_4bit":
        args = replace(args, grpo=replace(args.grpo, generation_weights="quantized"))
    from trainer.engine.harness import Engine
    from trainer.engine.setup import RunContext
    from trainer.grpo import build_model
    from trainer.rl.algorithms.grpo import GRPO
    from trainer.rl.settings import make_scorer

    plan = as_the_stage_plans("grpo", args, accelerator)
    clock = PhaseClock(probe)
    clock.start()
    # the stage's context, without the data it would train on: the model is built as the stage builds it
    ctx = RunContext(args.model, args.data, args.train, args.grpo, accelerator, tokenizer, splits=None, plan=plan)
    model = build_model(ctx)
    engine = Engine(model, args.train, accelerator, "grpo", accumulation_steps=args.mini_batch_size // plan.micro_batch_size,
                    optimizer=plan.optimizer)
    setup = clock.lap()
    result["setup"] = {"model": f"ONE {args.model_name_or_path} base, adapters {', '.join(model.adapter_names)}",
                       "trainable_parameters": sum(p.numel() for p in model.trainable_parameters()),
                       "step": "trainer.rl.online.rl_step with trainer.rl.algorithms.grpo.GRPO",
                       "generation": f"decode {plan.decode}, from {plan.generation_weights} weights (as the "
                                     "stage's budget plan picks them)"}
    result.update(setup_s=setup.seconds, setup_peak=setup.peaks)
    run_steps(engine, GRPO(args.grpo), make_scorer(args.grpo, tokenizer), args, plan, prompts, tokenizer, clock, result)


def run_trl(args: GRPOWorkload, prompts: list[list[int]], tokenizer, accelerator, probe: MemoryProbe,
            result: dict) -> None:
    """TRL's GRPOTrainer on the same base and rows: a step from its `on_step_begin` to `on_step_end`, the
    rollout up to the end of its `_generate_and_score_completions`."""
    import datasets
    from peft import LoraConfig
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.engine.optim import resolve_optimizer_name
    from trainer.model.loading import load_base_model
    from trainer.rl.rewards import builtin

    device = accelerator.device
    clock = PhaseClock(probe)
    clock.start()
    policy = load_base_model(args.model, vocab_size=len(tokenizer), device=device, checkpointing=False)
    reward = builtin(args.scripted_reward, "--scripted_reward")
    laps: dict[str, Any] = {}
    steps = result["steps"]

    class StepEvents(TrainerCallback):
        def on_train_begin(self, *_a, optimizer=None, **_k):
            laps["counter"] = StepCounter(optimizer)  # the Trainer makes its optimizer inside train()

        def on_step_begin(self, *_a, **_k):
            clock.start()

        def on_step_end(self, *_a, **_k):
            update = clock.lap()
            steps.append(step_record(len(steps) + 1, len(steps) < args.warmup_runs, laps.pop("rollout"), update,
                                     clock.parts, optimizer_steps=laps["counter"].take()))

    mixed = accelerator.mixed_precision
    out = tempfile.mkdtemp(prefix="trl-grpo-")
    config = GRPOConfig(
        output_dir=out, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed,
        bf16=mixed == "bf16", fp16=mixed == "fp16", use_cpu=device.type == "cpu",
        optim=resolve_optimizer_name(args.optimizer, device, quiet=True), learning_rate=args.learning_rate,
        lr_scheduler_type="constant", weight_decay=0.0, gradient_checkpointing=args.gradient_checkpointing,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.rows // args.micro_batch_size,
        num_generations=args.num_generations, max_completion_length=args.max_new_tokens, beta=args.beta,
        temperature=args.temperature, epsilon=args.cliprange, num_iterations=args.epochs, max_steps=args.total_steps,
        generation_kwargs={"min_new_tokens": args.max_new_tokens}, log_completions=False)
    peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                             target_modules=lora_targets(args.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    texts = [tokenizer.decode(p) for p in prompts]
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward.fn], args=config, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_dict({"prompt": texts}), peft_config=peft_config,
                          callbacks=[StepEvents()])
    del policy
    trainer.remove_callback(PrinterCallback)
    setup = clock.lap()
    result["setup"] = {"model": f"{args.model_name_or_path} with a LoRA adapter (peft), GRPOTrainer",
                       "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
                       "grpo_config": {k: getattr(config, k) for k in (
                           "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                           "generation_batch_size", "steps_per_generation", "max_completion_length", "beta",
                           "loss_type", "optim", "gradient_checkpointing", "bf16")}}
    result.update(setup_s=setup.seconds, setup_peak=setup.peaks)
    generate = trainer._generate_and_score_completions

    def timed_rollout(*a, **k):
        with clock.subphase("generate"):
            out_ = generate(*a, **k)
        laps["rollout"] = clock.lap()
        return out_

    trainer._generate_and_score_completions = timed_rollout
    try:
        trainer.train()
    finally:
        if "counter" in laps:
            laps["counter"].remove()
        trainer.accelerator.free_memory()
        trainer.model = trainer.optimizer = None
        shutil.rmtree(out, ignore_errors=True)


def run_side(name: str, args: GRPOWorkload, prompts, tokenizer, accelerator, probe: MemoryProbe) -> dict:
    """One side's record: setup, steps, the step metrics (ours), status and the device's NVML maximum."""
    from accelerate.utils import set_seed

    result: dict[str, Any] = {"side": name, "label": SIDES[name], "status": "ok", "error": None, "steps": [],
                              "setup": {}}
    release_memory()
    set_seed(args.seed)
    with side_errors(name, result):
        (run_ours if name in OURS else run_trl)(args, prompts, tokenizer, accelerator, probe, result)
    result["nvml_used_max_bytes"], probe.nvml_max = probe.nvml_max, None
    release_memory()
    return result


RATIO_KEYS = ("step_s", "rollout_s", "update_s", "peak_allocated_bytes", "peak_reserved_bytes", "nvml_used_max_bytes")


def ratios(ours: dict, trl: dict, side: str = "ours") -> dict[str, Optional[float]]:
    """Our side's figures over TRL's (below 1: ours is faster or lighter), keyed KEY_SIDE_over_trl: the issue's
    goals read these."""
    def over(key: str) -> Optional[float]:
        a, b = ours.get(key), trl.get(key)
        return a / b if a and b else None

    return {f"{key}_{side}_over_trl": over(key) for key in RATIO_KEYS}


def markdown(report: dict) -> str:
    gib = lambda v: f"{v / 2**30:.2f}" if v else "-"  # noqa: E731
    sec = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
    lines = [f"# GRPO step: ours vs TRL's GRPOTrainer ({report['settings']['model_name_or_path']}, "
             f"{report['device_name']})", "", f"- command: `{report['command']}`",
             f"- git revision: `{report['git_revision']}`, date {report['date']}",
             f"- work: {report['tokens_per_step']['generated']} generated tokens per step "
             f"({report['settings']['rollout_batch_size']} prompts x {report['settings']['num_generations']}); "
             f"{report['alloc_conf'] or 'PYTORCH_CUDA_ALLOC_CONF unset'}", "",
             *table_lines(["side", "status", "step s", "rollout s", "update s", "peak allocated GiB", "peak reserved GiB",
                           "device used GiB (NVML)", "peak RSS GiB"], "ll" + "r" * 7, [
                 [side["label"], side["status"],
                  *(sec(side["summary"].get(k)) for k in ("step_s", "rollout_s", "update_s")),
                  *(gib(side["summary"].get(k)) for k in ("peak_allocated_bytes", "peak_reserved_bytes",
                                                          "nvml_used_max_bytes", "peak_rss_bytes"))]
                 for side in report["sides"].values()])]
    found = report.get("ratios") or {}
    for side in OURS:
        over = [f"{key.removesuffix('_s').removesuffix('_bytes')} {found[f'{key}_{side}_over_trl']:.2f}x"
                for key in RATIO_KEYS if found.get(f"{key}_{side}_over_trl")]
        if over:
            lines += ["", f"{report['sides'][side]['label']} over TRL's: " + ", ".join(over)]
    errors = [f"- {s['label']}: {s['error']}" for s in report["sides"].values() if s.get("error")]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    import os

    from foundation.files import write_atomic
    from foundation.provenance import provenance, relative_command
    from trainer.engine.launch import ALLOC_CONF, make_accelerator, set_allocator_defaults
    from trainer.engine.setup import simulate_gpu_memory

    argv = list(sys.argv[1:] if argv is None else argv)
    args = GRPOWorkload.parse(argv)
    log_to_stdout()
    scratch = tempfile.mkdtemp(prefix="grpo-bench-")
    sides = args.sides.split(",")
    try:
        if args.isolate and not args.side_run_out:  # the parent starts no CUDA context: NVML sees each side alone
            set_allocator_defaults()  # the sides' processes inherit it
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            records = {name: side_in_own_process("benchmarks.grpo_vs_trl", name, SIDES[name], argv,
                                                  ("--sides", "--side_run_out", "--isolate")) for name in sides}
        else:
            accelerator = make_accelerator(replace(args.train, output_dir=scratch))  # the allocator's defaults too
            device, probe = accelerator.device, MemoryProbe(accelerator.device)
            simulate_gpu_memory(args.simulate_gpu_gib, device)  # the same cap for each side
            tokenizer = load_bench_tokenizer(args)
            prompts = fixed_length_prompts(args, tokenizer, args.total_steps * args.rollout_batch_size)
            records = {name: run_side(name, args, prompts, tokenizer, accelerator, probe) for name in sides}
            if args.side_run_out:
                Path(args.side_run_out).write_text(json.dumps(records[sides[0]], default=str))
                return records[sides[0]]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for record in records.values():
        record["summary"] = summarize(record, args.tokens())
    command = "python -m benchmarks.grpo_vs_trl " + relative_command(argv)
    report = {"kind": "grpo_vs_trl", **provenance(device, command), "alloc_conf": os.environ.get(ALLOC_CONF),
              "settings": {k: v for part in ("model", "data", "train", "grpo", "bench")
                           for k, v in asdict(getattr(args, part)).items()},
              "simulated_gpu_gib": args.simulate_gpu_gib if device.type == "cuda" else None,
              "tokens_per_step": args.tokens(), "sides": records}
    if "trl" in records:
        report["ratios"] = {k: v for side in OURS if side in records
                            for k, v in ratios(records[side]["summary"], records["trl"]["summary"], side).items()}
    out = Path(args.out_dir) if args.out_dir else ROOT / "benchmarks" / "results" / \
        f"grpo_vs_trl-{args.model_name_or_path}-{device.type}"
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "grpo_vs_trl.json", json.dumps(report, indent=2, default=str) + "\n")
    write_atomic(out / "grpo_vs_trl.md", markdown(report))
    logger.info("wrote %s", out / "grpo_vs_trl.md")
    return report


if __name__ == "__main__":
    run(main)
