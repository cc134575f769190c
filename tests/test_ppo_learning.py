"""PPO on the real embedded SmolLM2 learns a scripted reward within four steps, KL bounded."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_ppo_raises_a_scripted_reward_on_held_out_prompts_with_bounded_kl(learning_run):
    results, _ = learning_run("ppo", "tests/configs/smol_ppo_chars.yaml")
    before, after = results["eval_before"], results["eval_after"]
    assert before["step"] == 0 and after["step"] == 4
    assert before["eval/score_policy"] == before["eval/score_sft"]  # same adapter weights at step 0
    # The reward is -|characters - 8| / 8 (SFT's responses score about -3). The margin of these bounds over
    # seeds and with a flipped update: python -m benchmarks.learning_margin.
    gain = after["eval/score_policy"] - after["eval/score_sft"]
    assert gain >= 1.0, (before, after)
    assert after["eval/win_rate"] >= 0.75
    assert 0.0 < after["eval/kl"] < 30.0  # moved away from the reference, but boundedly
