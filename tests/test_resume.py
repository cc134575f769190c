"""Resume across epoch boundaries: a run killed with SIGKILL at a random step and resumed ends with
the same parameters and the same logged figures as the run that was never interrupted, for every
stage (SFT, reward, DPO, PPO and GRPO) on the tiny preset and real hh-rlhf rows. The killed run has a
process of its own; the uninterrupted and the resumed run run in the test's process; all with one thread."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import in_process_command, run_to_be_killed
from safetensors.torch import load_file

from benchmarks.row_trace import traced

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
TINY_PPO = ROOT / "tests" / "configs" / "tiny_ppo.yaml"
TINY_GRPO = ROOT / "tests" / "configs" / "tiny_grpo.yaml"

# Each run is short enough to take seconds and long enough to cross at least two epoch boundaries:
# (config, extra flags, optimizer steps per epoch, total steps).
STAGES = {
    # 16 pairs -> 12-16 SFT rows that fit max_length 96 -> 1.5-2 steps of 2 x 4 rows per epoch.
    "sft": (TINY_SFT, ["--sft_size", "16", "--max_steps", "7", "--eval_every", "0"], 2, 7),
    # 8 pairs of 96 tokens at most -> 2 steps of 4 pairs per epoch (accumulation 1).
    "reward": (TINY_SFT, ["--reward_size", "8", "--gradient_accumulation_steps", "1", "--max_steps", "7",
                          "--eval_every", "0"], 2, 7),
    "dpo": (TINY_SFT, ["--reward_size", "8", "--gradient_accumulation_steps", "1", "--max_steps", "7",
                       "--eval_every", "0"], 2, 7),
    # 16 prompts, 8 per rollout -> 2 PPO steps per epoch.
    "ppo": (TINY_PPO, ["--ppo_size", "16", "--max_steps", "7"], 2, 7),
    # 8 prompts, 4 per step (x 4 responses each) -> 2 GRPO steps per epoch.
    "grpo": (TINY_GRPO, ["--ppo_size", "8", "--max_steps", "7"], 2, 7),
}
KEYS = ("train/loss", "train/grad_norm", "train/lr", "objective/scores", "objective/kl", "loss/policy_avg",
        "loss/value_avg", "loss", "reward", "kl", "eval/loss", "eval/accuracy", "eval/rewards/accuracies",
        "eval/score_policy")


def stage_argv(stage: str, out: Path) -> list[str]:
    config, extra, _, _ = STAGES[stage]
    return ["--config", str(config), "--output_dir", str(out), "--save_every", "1", "--keep_checkpoints", "20", *extra]


def run_here(stage: str, out: Path, trace: Path) -> str:
    """A run that is not killed, in this process with one thread as the killed one (`in_process_command`), its
    rows recorded alike: its log."""
    with traced(trace):
        proc = in_process_command(f"trainer.{stage}", stage_argv(stage, out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def logged(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: r[k] for k in ("step", *KEYS) if k in r} for r in rows]


def traced_rows(trace: Path) -> list[tuple[int, list[str]]]:
    """(step, row hashes) of every micro-batch, in order, from the rank-0 trace."""
    lines = (trace / "rows-rank0.jsonl").read_text().splitlines()
    return [(r["step"], r["rows"]) for r in map(json.loads, lines)]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("stage", list(STAGES))
def test_sigkill_at_a_random_step_past_epoch_boundaries_resumes_to_the_uninterrupted_run(stage, tmp_path, forks):
    _, _, per_epoch, total = STAGES[stage]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_here(stage, straight, tmp_path / "trace-straight")
    # A step after the first epoch boundary, so the resumed run starts inside epoch 1 or later and
    # then crosses another boundary before the end.
    seed = random.randrange(10**6)
    kill_after = random.Random(seed).randint(per_epoch + 1, total - 2)
    killed_log = tmp_path / "killed.log"
    proc = forks.Process(target=run_to_be_killed, args=(f"trainer.{stage}", stage_argv(stage, killed), killed_log),
                         kwargs={"trace": tmp_path / "trace-killed"})
    proc.start()
    checkpoint = killed / f"checkpoint-{kill_after:07d}"
    deadline = time.time() + 300
    while not checkpoint.is_dir():
        assert proc.is_alive(), f"(seed {seed}) run ended before step {kill_after}: {killed_log.read_text()[-2000:]}"
        assert time.time() < deadline, f"(seed {seed}) no checkpoint at step {kill_after}"
        time.sleep(0.01)
    proc.kill()  # SIGKILL
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert not (killed / "adapter").exists(), f"(seed {seed}) the run finished before the kill"
    log = run_here(stage, killed, tmp_path / "trace-resumed")
    assert "resumed from" in log
    assert logged(killed) == logged(straight), f"seed {seed}, killed after step {kill_after}"
    # Row by row, the killed run up to its checkpoint and then the resumed run read exactly the rows
    # the uninterrupted run read at each step.
    resumed_from = int(log.split("resumed from")[1].split("step ")[1].split(")")[0])
    before = [r for r in traced_rows(tmp_path / "trace-killed") if r[0] <= resumed_from]
    assert before + traced_rows(tmp_path / "trace-resumed") == traced_rows(tmp_path / "trace-straight"), (
        f"seed {seed}, resumed from step {resumed_from}")
    a, b = final_weights(straight), final_weights(killed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} (seed {seed}, killed after step {kill_after})"
