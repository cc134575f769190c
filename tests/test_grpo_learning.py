"""GRPO on the real embedded SmolLM2 learns a scripted reward within four steps, KL bounded: the same
reward, prompts and responses per step as PPO's learning check (tests/test_ppo_learning.py)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_grpo_raises_a_scripted_reward_on_held_out_prompts_with_bounded_kl(learning_run):
    results, out = learning_run("grpo", "tests/configs/smol_grpo_chars.yaml")
    before, after = results["eval_before"], results["eval_after"]
    assert before["step"] == 0 and after["step"] == 4
    assert before["eval/score_policy"] == before["eval/score_sft"]  # same adapter weights at step 0
    # The margin of these bounds over seeds and with a flipped update: python -m benchmarks.learning_margin.
    gain = after["eval/score_policy"] - after["eval/score_sft"]
    assert gain >= 1.0, (before, after)
    assert after["eval/win_rate"] >= 0.75
    assert 0.0 < after["eval/kl"] < 20.0  # moved away from the reference, but boundedly
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 4 and sum(rewards[-2:]) > sum(rewards[:2])  # the training reward rose too
