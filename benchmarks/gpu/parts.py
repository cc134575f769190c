"""The parts of the GPU kit, each a list of commands run one after another into one folder.

    python -m benchmarks.gpu.parts PART --out DIR [--smoke]

What each part measures, and the order to run them: benchmarks/gpu/README.md. Each step runs in its own
process with what is left of the part's budget; a step that fails or runs out of time is recorded and
the part goes on. `manifest.json` says what ran, how long, and where. `--smoke` runs the same code paths
on the CPU with the tiny preset: CI does, so the kit cannot rot between GPU sessions.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks.processes import EXIT_CUT, run_stoppable
from foundation.cli import Checked, UsageError, at_least, one_of, parse, run
from foundation.files import write_atomic

ROOT = Path(__file__).resolve().parent.parent.parent
PARTS = ("first", "check", "memory", "speed", "grpo_vs_trl", "ladder", "stages", "grpo_recipe")
# Seconds of steps; the wheel install and packing come on top: each part fits one 8-minute call.
BUDGET_S = {"first": 420, "check": 240, "memory": 420, "speed": 420, "grpo_vs_trl": 420, "ladder": 420,
            "stages": 420, "grpo_recipe": 420}
CUT = "cut"  # the part's budget ran out before (or while) the step ran: a step never measured, not a result
STOP_MARGIN_S = 15  # what a step given a stop time keeps for writing its files before the part's deadline


@dataclass
class PartArguments(Checked):
    part: str = field(default="first", metadata={
        "help": "first, check, memory, grpo_recipe, speed, grpo_vs_trl, ladder or stages."})
    out: str = field(default="gpu-out", metadata={"help": "Folder the part writes into (then packed by run.sh)."})
    smoke: bool = field(default=False, metadata={"help": "Same code paths on the CPU with the tiny preset."})
    data: str = field(default=".data/hh-rlhf", metadata={"help": "hh-rlhf rows carried to the GPU machine."})
    tokenizer: str = field(default=".data/tokenizer", metadata={"help": "Exported tokenizer (prepare.sh)."})
    budget_s: int = field(default=0, metadata={"help": "Seconds the whole part may take; 0: the part's own "
                                               "(check 240, the others 420: with the wheel install and "
                                               "packing, a call of at most 8 minutes)."})

    RULES = {"part": one_of(*PARTS), "budget_s": at_least(0)}


@dataclass
class Step:
    name: str
    argv: list[str]
    status: str = "not run"
    seconds: float = 0.0
    tail: str = ""


def python() -> str:
    return sys.executable


def interpreter_named(argv: list[str]) -> list[str]:
    """A step's command as the manifest shows it: this Python as `python`, not the machine's path to it."""
    return ["python", *argv[1:]] if argv[:1] == [python()] else argv


def model_flags(args: PartArguments) -> list[str]:
    """The model: 7B architecture in NF4 on the GPU; the tiny preset in NF4 on the CPU for the smoke run."""
    if args.smoke:
        return ["--model_name_or_path", "tiny-llama", "--quantization", "nf4", "--lora_r", "4", "--lora_alpha", "8"]
    return ["--model_name_or_path", "llama-2-7b", "--quantization", "nf4", "--dtype", "bfloat16",
            "--tokenizer_name_or_path", args.tokenizer]


def cap_flags(args: PartArguments) -> list[str]:
    return [] if args.smoke else ["--simulate_gpu_gib", "24"]


def data_path(args: PartArguments) -> str:
    """The carried rows on the GPU machine; the shared rows ($RLHF_DATA or ../shared) for the smoke run."""
    if not args.smoke:
        return args.data
    from foundation.settings import DATA_ENV
    from trainer.config import SHARED_DATA

    return os.path.relpath(os.environ.get(DATA_ENV) or SHARED_DATA, ROOT)


def data_flags(args: PartArguments) -> list[str]:
    return ["--dataset", data_path(args)]


def stage_run(args: PartArguments, stage: str, out: Path, *extra: str) -> list[str]:
    """One stage of the seed recipe, a few steps long, its memory recorded against the 24 GB budget."""
    small = ["--eval_size", "16", "--sft_size", "64", "--reward_size", "64", "--ppo_size", "64"]
    smoke = ["--max_length", "96", "--max_prompt_length", "24", "--micro_batch_size", "2",
             "--gradient_accumulation_steps", "1", "--optimizer", "adamw_8bit", "--mixed_precision", "no",
             "--dtype", "float32"] if args.smoke else []
    return [python(), f"trainer/{stage}.py", "--config", f"trainer/configs/llama2_7b/{stage}.yaml",
            "--output_dir", str(out / stage), *model_flags(args), *data_flags(args), *small, *cap_flags(args),
            "--max_steps", "2" if args.smoke else "3", "--eval_every", "0", "--eval_batches", "1", "--save_every", "0",
            "--report_to", "none", "--progress_bar", "false", "--profile_memory", "true", "--resume", "no",
            *smoke, *extra]


def stages_vs_trl(args: PartArguments, stage: str, out: Path) -> list[str]:
    """`benchmarks.stages_vs_trl` at 7B NF4 under the cap: a few steps, speed and memory only (random weights)."""
    if args.smoke:  # CI's one run of the DPO comparison: 64 pairs to draw its rows from (not the whole split
        # tokenized), and the tensor walk and held-out scoring of both sides (tests/test_gpu_kit.py checks them)
        work = ["--max_length", "96", "--min_prompt_tokens", "4", "--micro_batch_size", "2",
                "--gradient_accumulation_steps", "1", "--max_steps", "2", "--optimizer", "adamw_8bit",
                "--mixed_precision", "no", "--dtype", "float32", "--reward_size", "64", "--profile_memory", "true"]
    else:
        work = ["--max_length", "512", "--micro_batch_size", "4", "--gradient_accumulation_steps", "2",
                "--max_steps", "3", "--optimizer", "paged_adamw_8bit", "--gradient_checkpointing", "true",
                "--attn_implementation", "sdpa", "--lora_r", "16", "--lora_alpha", "32"]
    return [python(), "-m", "benchmarks.stages_vs_trl", "--stage", stage, *model_flags(args), *data_flags(args),
            *cap_flags(args), *work, "--eval_size", "16", "--warmup_runs", "1",
            "--evaluate", "true" if args.smoke else "false", "--out_dir", str(out / f"stages_vs_trl-{stage}")]


def grpo_recipe_run(args: PartArguments, out: Path, name: str = "grpo", *extra: str, planned: bool = False
                    ) -> list[str]:
    """TRL's QLoRA GRPO recipe (Qwen2.5-7B shapes, r=32 on every linear layer, 8 completions of 256 tokens per
    step and per pass, beta 0, a scored reward instead of a reward model, paged 8-bit AdamW, checkpointing),
    2 steps with memory recorded into out/`name`, with the `extra` flags: what `benchmarks.trl_grpo_recipe`
    predicts. `planned`: the passes' micro-batch sizes left to the budget planner (8 rows a pass otherwise)."""
    rows = "4" if args.smoke else "8"
    micro = [] if planned else ["--micro_batch_size", rows, "--rollout_micro_batch_size", rows]
    if args.smoke:
        model = ["--model_name_or_path", "tiny-llama", "--quantization", "nf4", "--mixed_precision", "no",
                 "--dtype", "float32", "--optimizer", "adamw_8bit"]
        shape = ["--num_generations", "4", "--max_new_tokens", "8", "--min_new_tokens", "8", "--max_prompt_length", "24",
                 *micro, "--mini_batch_size", "4"]
    else:
        model = ["--model_name_or_path", "qwen2.5-7b", "--quantization", "nf4", "--dtype", "bfloat16",
                 "--tokenizer_name_or_path", args.tokenizer, "--optimizer", "paged_adamw_8bit",
                 "--attn_implementation", "sdpa", *cap_flags(args)]
        shape = ["--num_generations", "8", "--max_new_tokens", "256", "--min_new_tokens", "256",
                 "--max_prompt_length", "256", *micro, "--mini_batch_size", "8"]
    return [python(), "trainer/grpo.py", "--config", "trainer/configs/llama2_7b/grpo.yaml",
            "--output_dir", str(out / name), *model, *data_flags(args), "--lora_r", "32", "--lora_alpha", "32",
            "--eval_size", "16", "--sft_size", "64", "--reward_size", "64", "--ppo_size", "64",
            "--sft_adapter", "null", "--reward_adapter", "null", "--scripted_reward", "chars:200", "--beta", "0",
            "--rollout_batch_size", "1", *shape, "--gradient_checkpointing", "true", "--max_steps", "2",
            "--eval_every", "0", "--eval_prompts", "0", "--save_every", "0", "--report_to", "none",
            "--progress_bar", "false", "--profile_memory", "true", "--resume", "no", *extra]


# The GPU tests the first call keeps: the correctness of the CUDA path, which its later steps only run.
FIRST_GPU_TESTS = "nf4 or paged or moves_only or recorder or simulated"
# The GPU tests, each named in the log with its time as it ends: a run the budget cuts still shows which ran
GPU_TESTS = [python(), "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-v", "-o", "console_output_style=times",
             "tests/test_gpu.py"]


def ppo_work(args: PartArguments) -> list[str]:
    """The PPO work of the speed comparison: 16 prompts of 256 tokens, 128 new tokens (a few on the CPU)."""
    if args.smoke:
        return ["--prompt_length", "16", "--max_new_tokens", "6", "--rollout_batch_size", "4",
                "--rollout_micro_batch_size", "4", "--mini_batch_size", "2", "--micro_batch_size", "2",
                "--steps", "1", "--warmup_runs", "1"]
    return ["--attn_implementation", "sdpa", "--optimizer", "paged_adamw_8bit", "--prompt_length", "256",
            "--max_new_tokens", "128", "--rollout_batch_size", "16", "--rollout_micro_batch_size", "16",
            "--mini_batch_size", "8", "--micro_batch_size", "4", "--ppo_epochs", "2", "--steps", "1",
            "--warmup_runs", "1", "--lora_r", "16", "--lora_alpha", "32"]


def seed_ppo_steps(args: PartArguments, out: Path, ppo_steps: int) -> list[Step]:
    """SFT and reward (their adapters), then the seed recipe's PPO, each with its memory recorded."""
    ppo = ["--sft_adapter", str(out / "sft" / "adapter"), "--reward_adapter", str(out / "reward" / "adapter"),
           "--eval_prompts", "0", "--min_new_tokens", "128" if not args.smoke else "8"]
    if args.smoke:
        ppo += ["--max_new_tokens", "8", "--rollout_batch_size", "4", "--rollout_micro_batch_size", "4",
                "--mini_batch_size", "2"]
    ppo_step = Step("ppo", stage_run(args, "ppo", out, *ppo, "--max_steps", str(ppo_steps)))
    if args.part == "memory":
        return [Step("sft", stage_run(args, "sft", out)),
                Step("reward", stage_run(args, "reward", out, "--sft_adapter", str(out / "sft" / "adapter"))),
                ppo_step]
    # PPO keeps a process of its own, so that nothing an earlier stage left behind can show in its memory.
    return [in_one_process("sft+reward", sft_and_reward(args, out)), ppo_step]


def sft_and_reward(args: PartArguments, out: Path) -> list[list[str]]:
    """One step each of SFT and reward: where no SFT or reward figure is reported, they only make the adapters the
    RL stage starts from."""
    return [stage_run(args, "sft", out, "--max_steps", "1"),
            stage_run(args, "reward", out, "--sft_adapter", str(out / "sft" / "adapter"), "--max_steps", "1")]


def in_one_process(name: str, runs: list[list[str]]) -> Step:
    """Stage runs (each `python trainer/STAGE.py ARGS`) one after another in ONE process: one start, one CUDA
    context (`benchmarks.gpu.in_one_process`)."""
    argv = [python(), "-m", "benchmarks.gpu.in_one_process"]
    for i, stage in enumerate(runs):
        argv += [*(["::"] if i else []), Path(stage[1]).stem, *stage[2:]]
    return Step(name, argv)


def steps_for(args: PartArguments, out: Path, deadline: float = 0.0) -> list[Step]:
    if args.part == "first":
        # Decode at batch 16 is the PPO run's own rollout (16 rows, 128 new tokens each, min == max), read from
        # its metrics with its fraction of the bandwidth bound: no model is built for it alone.
        return [Step("gpu-tests", [*GPU_TESTS, "-k", FIRST_GPU_TESTS, f"--junitxml={out / 'gpu-tests.xml'}"]),
                *seed_ppo_steps(args, out, ppo_steps=2),
                Step("vs-estimate", [python(), "-m", "benchmarks.gpu.vs_estimate", str(out / "ppo")]),
                Step("ppo_vs_trl", [python(), "-m", "benchmarks.ppo_vs_trl", *model_flags(args), *data_flags(args),
                                    *cap_flags(args), *ppo_work(args), "--sides", "ours,trl",
                                    "--stop_at", f"{max(deadline - STOP_MARGIN_S, 0):.0f}",
                                    "--out_dir", str(out / "ppo_vs_trl")])]
    if args.part == "check":
        return [Step("nvidia-smi", ["nvidia-smi"]),
                Step("gpu-tests", [*GPU_TESTS, f"--junitxml={out / 'gpu-tests.xml'}"])]
    if args.part == "memory":
        # GRPO (trainer/configs/llama2_7b/grpo.yaml: 4 prompts x 4 responses, no value adapter) after PPO,
        # so that a part cut short by its budget still has the PPO figures.
        grpo = ["--sft_adapter", str(out / "sft" / "adapter"), "--reward_adapter", str(out / "reward" / "adapter"),
                "--eval_prompts", "0", "--min_new_tokens", "128" if not args.smoke else "8"]
        grpo += (["--max_new_tokens", "8", "--rollout_batch_size", "2", "--num_generations", "2",
                  "--rollout_micro_batch_size", "4", "--mini_batch_size", "2"] if args.smoke else [])
        # Smoke: the first call's smoke runs the seed PPO (the same stage_run), so here SFT, reward and GRPO run in
        # one process; the estimator comparison still reads SFT, reward and GRPO.
        grpo_run = stage_run(args, "grpo", out, *grpo, "--max_steps", "2")
        runs = ([in_one_process("sft+reward+grpo", [*sft_and_reward(args, out), grpo_run])] if args.smoke else
                [*seed_ppo_steps(args, out, ppo_steps=3), Step("grpo", grpo_run)])
        stages = ("sft", "reward", "grpo") if args.smoke else ("sft", "reward", "ppo", "grpo")
        compare = [python(), "-m", "benchmarks.gpu.vs_estimate", *(str(out / s) for s in stages)]
        return [*runs, Step("vs-estimate", compare)]
    if args.part == "speed":  # the rollouts as the stages run them (--decode and --generation_weights auto, the
        # planner's picks) in TRL's GRPO recipe, 3 steps (the third past any one-off cost of the second); decode
        # alone; then the first call's PPO work against TRL, ours with its decoder layers compiled for the update
        # (--compile_layers). A step the budget cuts keeps its last finished results (collect).
        decode = [python(), "-m", "benchmarks.gpu.decode"]
        if args.smoke:
            sizes = ["--prompt_tokens", "8", "--new_tokens", "4", "--repeats", "1", "--copy_gib", "0.05"]
            recipe_decode = [*model_flags(args), "--batches", "4", *sizes]
        else:
            sizes = ["--prompt_tokens", "128", "--new_tokens", "64"]
            recipe_decode = ["--model_name_or_path", "qwen2.5-7b", "--quantization", "nf4", "--dtype", "bfloat16",
                             "--attn_implementation", "sdpa", "--lora_r", "32", "--lora_alpha", "32", "--batches", "8",
                             "--prompt_tokens", "256", "--new_tokens", "256"]
        dense = ["--paths", "compiled", "--weights", "dequantized"]
        # decode: the compiled step from the dense copy (the planner's pick where it fits), its decoder layers as
        # one region, at 16 and 1 rows in one build, the 16 rows' step profiled (eager, the 4-bit weights and the
        # step compiled whole: measured at 60b44b7, f9fb2bd and 76ae41a, behind); last, the GRPO recipe's own
        # decode (its model, 8 rows, 256 + 256 tokens), profiled too: the recipe's rollout against decode alone
        steps = [Step("grpo", grpo_recipe_run(args, out, "grpo", "--max_steps", "3")),
                 Step("vs-estimate", [python(), "-m", "benchmarks.gpu.vs_estimate", str(out / "grpo")]),
                 Step("decode", [*decode, *model_flags(args), *dense, "--batches", "4" if args.smoke else "16,1",
                                 *sizes, "--out_dir", str(out / "decode"),
                                 "--kernel_profile", str(out / "decode" / "kernels")])]
        if not args.smoke:  # ppo_vs_trl: the first call's smoke runs it
            steps.append(Step("ppo_vs_trl", [python(), "-m", "benchmarks.ppo_vs_trl", *model_flags(args),
                                             *data_flags(args), *cap_flags(args), *ppo_work(args),
                                             "--compile_layers", "true", "--sides", "ours,trl",
                                             "--stop_at", f"{max(deadline - STOP_MARGIN_S, 0):.0f}",
                                             "--out_dir", str(out / "ppo_vs_trl")]))
        steps.append(Step("decode-grpo", [*decode, *recipe_decode, *dense, "--out_dir", str(out / "decode_grpo"),
                                          "--kernel_profile", str(out / "decode_grpo" / "kernels")]))
        return steps
    if args.part == "grpo_vs_trl":  # TRL's QLoRA GRPO recipe on ours and on TRL's GRPOTrainer, same cap; then
        # the seed PPO recipe under a 12 GB cap: does the smallest card the estimator allows hold it, and is
        # each phase's device memory the estimate's?
        work = (["--model_name_or_path", "tiny-llama", "--quantization", "nf4", "--dtype", "float32",
                 "--mixed_precision", "no", "--optimizer", "adamw_8bit", "--lora_r", "4", "--lora_alpha", "8",
                 "--max_new_tokens", "4", "--num_generations", "2", "--rollout_batch_size", "2",
                 "--mini_batch_size", "4", "--micro_batch_size", "2", "--rollout_micro_batch_size", "4",
                 "--prompt_length", "16"] if args.smoke else
                ["--model_name_or_path", "qwen2.5-7b", "--quantization", "nf4", "--dtype", "bfloat16",
                 "--tokenizer_name_or_path", args.tokenizer, "--attn_implementation", "sdpa", *cap_flags(args)])
        ppo = ["--sft_adapter", str(out / "sft" / "adapter"), "--reward_adapter", str(out / "reward" / "adapter"),
               "--eval_prompts", "0", "--min_new_tokens", "8" if args.smoke else "128"]
        if args.smoke:
            ppo += ["--max_new_tokens", "8", "--rollout_batch_size", "4", "--rollout_micro_batch_size", "4",
                    "--mini_batch_size", "2"]
        return [Step("grpo_vs_trl", [python(), "-m", "benchmarks.grpo_vs_trl", *work, *data_flags(args),
                                     "--sides", "ours,ours_4bit,trl", "--out_dir", str(out / "grpo_vs_trl")]),
                in_one_process("sft+reward", sft_and_reward(args, out)),
                Step("ppo-12gb", stage_run(args, "ppo", out, *ppo, "--max_steps", "2",
                                           *([] if args.smoke else ["--simulate_gpu_gib", "12"]),
                                           "--memory_budget_gib", "12")),
                Step("vs-estimate-12gb", [python(), "-m", "benchmarks.gpu.vs_estimate", str(out / "ppo")])]
    if args.part == "grpo_recipe":  # TRL's published QLoRA GRPO recipe, under the 24 GB cap, against the estimator;
        # then under an 8 GB cap and budget, the planner choosing micro-batches and offloads: does an 8 GB card
        # hold it? (an over-budget plan stops the run at its start, naming what to change)
        small = ("--memory_budget_gib", "8") if args.smoke else ("--simulate_gpu_gib", "8", "--memory_budget_gib", "8")
        compare = [python(), "-m", "benchmarks.gpu.vs_estimate"]
        runs = [grpo_recipe_run(args, out), grpo_recipe_run(args, out, "grpo_8gb", *small, planned=True)]
        if args.smoke:  # no budget to order the steps by: both runs in one process, then one comparison of both
            return [in_one_process("grpo+grpo-8gb", runs),
                    Step("vs-estimate", [*compare, str(out / "grpo"), str(out / "grpo_8gb")])]
        return [Step("grpo", runs[0]), Step("vs-estimate", [*compare, str(out / "grpo")]),
                Step("grpo-8gb", runs[1]), Step("vs-estimate-8gb", [*compare, str(out / "grpo_8gb")])]
    if args.part == "stages":
        stages = ("dpo",) if args.smoke else ("sft", "reward", "dpo")  # smoke: see the module's docstring
        return [Step(f"stages_vs_trl-{stage}", stages_vs_trl(args, stage, out)) for stage in stages]
    # The ladder varies quantization, dtype, attention, checkpointing and optimizer itself.
    extra = {"dataset": data_path(args), "eval_size": 16, "sft_size": 64, "reward_size": 64, "ppo_size": 64}
    if args.smoke:
        extra.update(max_length=96, micro_batch_size=2, gradient_accumulation_steps=1, lora_r=64, lora_alpha=128,
                     mixed_precision="no")
    else:
        extra["tokenizer_name_or_path"] = args.tokenizer
    return [Step("ladder", [python(), "-m", "benchmarks.flag_ladder", "--stage", "sft", "--model_name_or_path",
                            "tiny-llama" if args.smoke else "llama-2-7b", "--config", "trainer/configs/llama2_7b/sft.yaml",
                            "--steps", "2" if args.smoke else "3", "--extra",
                            ",".join(f"{k}={v}" for k, v in extra.items()), *cap_flags(args),
                            "--with_deepspeed", "false" if args.smoke else "true", "--out_dir", str(out / "ladder"),
                            "--timeout_s", "300" if args.smoke else "150"])]


def library_versions() -> dict:
    """Python, torch, CUDA and the libraries this machine runs the part with (or why they cannot be read)."""
    from benchmarks.gpu.versions import versions

    try:
        return versions()
    except Exception as exc:  # a broken CUDA install still lets the steps record how they fail
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def device_facts() -> dict:
    """The GPU's name and driver (nvidia-smi), or the CPU's, for the manifest and the results folder."""
    import torch

    from foundation.provenance import device_name

    facts = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    facts["device_name"] = device_name(torch.device(facts["device"]))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    facts["device_slug"] = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-").replace("--", "-")
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = None
    return facts


# The machine's folders a log names besides the project: the kit's wheel installs (run.sh) and any Python's
# site-packages (a library's warning names its file).
MACHINE_FOLDERS = re.compile(r"(?:/tmp/(?:site|pinned)|[^\s'\"():]*/(?:site|dist)-packages)/")


def without_machine_folders(text: str) -> str:
    """A log's text naming the project's files from its root and a library's from its package."""
    return MACHINE_FOLDERS.sub("", text.replace(f"{ROOT}/", ""))


def run_steps(steps: list[Step], out: Path, deadline: float) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for step in steps:
        left = deadline - time.time()
        if left < 10:
            step.status = CUT
            continue
        started = time.time()
        log = out / "logs" / f"{step.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(log, "w") as f:
                code = run_stoppable(step.argv, left, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            step.status = CUT if code in (None, EXIT_CUT) else "ok" if code == 0 else f"exit {code}"
        except OSError as exc:  # nvidia-smi on a machine without it
            step.status = f"not available ({exc.strerror or exc})"
        step.seconds = time.time() - started
        if log.is_file():  # the log and its tail name files from the repo root, never the machine's folders
            text = without_machine_folders(log.read_text(errors="replace"))
            log.write_text(text)
            step.tail = text[-3000:]
        print(f"[{step.name}] {step.status} in {step.seconds:.0f} s", flush=True)


def main(argv: Optional[list[str]] = None) -> dict:
    from foundation.provenance import provenance, relative_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--part", *argv]
    (args,) = parse([PartArguments], argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty: a part writes into a fresh folder")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    found = library_versions()  # in this process: a step of its own would pay a process start for it
    write_atomic(out / "versions.json", json.dumps(found, indent=2))
    budget = args.budget_s or BUDGET_S[args.part]
    steps = steps_for(args, out, started + budget)
    run_steps(steps, out, started + budget)
    junit = out / "gpu-tests.xml"
    if junit.is_file():  # pytest writes a skipped test's location as an absolute path: name it from the root
        write_atomic(junit, junit.read_text().replace(f"{ROOT}/", ""))
    model = "tiny-llama" if args.smoke else "llama-2-7b"
    manifest = {**provenance(command="benchmarks/gpu/run.sh " + ("--smoke " if args.smoke else "") + args.part),
                **device_facts(), "versions": found, "part": args.part, "smoke": args.smoke, "model": model, "arguments": asdict(args),
                "seconds": time.time() - started, "budget_s": budget,
                "steps": [{**asdict(s), "argv": shlex.split(relative_command(interpreter_named(s.argv)))}
                          for s in steps]}
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=2))
    print(f"part {args.part}: " + ", ".join(f"{s.name} {s.status}" for s in steps), flush=True)
    return manifest


if __name__ == "__main__":
    run(main)
