"""The online RL budget planner (profiling/plan.py): batch sizes and checkpointing chosen from the estimate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from profiling.plan import plan_rl
from profiling.predict import EstimateArguments, estimate
from profiling.shapes import load_shape

SEVEN_B = load_shape("llama-2-7b")
# trainer/configs/llama2_7b/ppo.yaml's settings (NF4, bf16, paged 8-bit AdamW, LoRA r=16 all-linear)
RECIPE = EstimateArguments(stage="ppo", rollout_batch_size=16, rollout_micro_batch_size=16, micro_batch_size=4,
                           max_prompt_length=256, max_new_tokens=128, lora_dropout=0.0)


@pytest.mark.parametrize("budget, rollout_rows, micro, checkpointing", [
    # the recipe's own batch: every budget holds 16 rows per pass and micro-batches of the whole minibatch
    (24, 16, 8, True), (16, 16, 8, True), (12, 16, 8, True),
])
def test_the_7b_recipe_plan_at_24_16_and_12_gb(budget, rollout_rows, micro, checkpointing):
    plan = plan_rl(SEVEN_B, replace(RECIPE, memory_budget_gib=budget), mini_batch_size=8)
    assert (plan.rollout_micro_batch_size, plan.micro_batch_size, plan.gradient_checkpointing) == \
        (rollout_rows, micro, checkpointing)
    assert plan.peak_bytes <= plan.usable_bytes == int(budget * 2**30 * 0.9)


# (the scoring pass holds reference, value and reward rows: the policy's old log-probs come from sampling)
@pytest.mark.parametrize("budget, rollout_rows, micro", [(24, 64, 16), (16, 32, 16), (12, 16, 8), (8, 8, 2)])
def test_a_64_prompt_rollout_is_split_to_what_each_budget_holds(budget, rollout_rows, micro):
    args = replace(RECIPE, rollout_batch_size=64, memory_budget_gib=budget)
    plan = plan_rl(SEVEN_B, args, mini_batch_size=16)
    assert (plan.rollout_micro_batch_size, plan.micro_batch_size, plan.gradient_checkpointing) == \
        (rollout_rows, micro, True)
    # the largest that fits: the next divisor up does not
    bigger = [d for d in (1, 2, 4, 8, 16, 32, 64) if d > rollout_rows]
    if bigger:
        over = estimate(SEVEN_B, replace(args, rollout_micro_batch_size=bigger[0], micro_batch_size=micro))
        assert any(p["total"] > plan.usable_bytes for p in over["phases"] if p["phase"] in ("generate", "score"))
    assert "<- peak" in plan.table() and f"rollout_micro_batch_size {rollout_rows}" in plan.table()


# trainer/configs/llama2_7b/grpo.yaml's settings: 4 prompts x 4 responses, no value adapter
GRPO = replace(RECIPE, stage="grpo", rollout_batch_size=4, num_generations=4)


@pytest.mark.parametrize("budget, rollout_rows, micro, checkpointing", [
    # no value rows in the update: at 24 GB a micro-batch of 4 fits without recomputation, and that is
    # at least half of the 8 checkpointing would allow, so the recompute is not worth it
    (24, 16, 4, False), (16, 16, 8, True), (12, 16, 8, True), (8, 8, 4, True),
])
def test_the_7b_grpo_recipe_plan_at_24_16_and_12_gb(budget, rollout_rows, micro, checkpointing):
    plan = plan_rl(SEVEN_B, replace(GRPO, memory_budget_gib=budget), mini_batch_size=8)
    assert (plan.rollout_micro_batch_size, plan.micro_batch_size, plan.gradient_checkpointing) == \
        (rollout_rows, micro, checkpointing)
    assert plan.peak_bytes <= plan.usable_bytes


def test_grpo_rollout_rows_are_prompts_times_generations():
    plan = plan_rl(SEVEN_B, replace(GRPO, rollout_batch_size=16, memory_budget_gib=24), mini_batch_size=16)
    assert plan.rollout_micro_batch_size == 64  # 16 prompts x 4 responses in one pass: more than the prompts


def test_the_planner_plans_online_rl_stages_only():
    with pytest.raises(ValueError, match="not 'sft'"):
        plan_rl(SEVEN_B, replace(RECIPE, stage="sft"), mini_batch_size=8)


def test_checkpointing_is_turned_off_where_the_update_fits_without_it():
    small = load_shape("tiny-llama")
    plan = plan_rl(small, replace(RECIPE, model_name_or_path="tiny-llama", quantization="none", dtype="float32",
                                   memory_budget_gib=24), mini_batch_size=8)
    assert plan.gradient_checkpointing is False and plan.micro_batch_size == 8


def test_nothing_fits_gives_no_plan():
    assert plan_rl(SEVEN_B, replace(RECIPE, memory_budget_gib=3), mini_batch_size=8) is None


def test_auto_fit_is_off_on_cpu_by_default_and_applies_the_plan_when_asked(tmp_path, capfd, fresh_accelerate_state):
    from trainer.engine.setup import start_run
    from trainer.ppo import PPOArguments

    base = ["--config", "tests/configs/tiny_ppo.yaml", "--scripted_reward", "length:4",
            "--rollout_micro_batch_size", "2", "--gradient_checkpointing", "true"]
    ctx = start_run(PPOArguments, [*base, "--output_dir", str(tmp_path / "off")], stage="ppo")
    assert ctx.stage_args.rollout_micro_batch_size == 2 and ctx.model_args.gradient_checkpointing is True
    assert "budget plan" not in "".join(capfd.readouterr())
    ctx = start_run(PPOArguments, [*base, "--output_dir", str(tmp_path / "on"), "--auto_fit", "true"], stage="ppo")
    logged = "".join(capfd.readouterr())
    assert ctx.stage_args.rollout_micro_batch_size == ctx.stage_args.rollout_batch_size
    assert ctx.model_args.gradient_checkpointing is False  # the tiny model's update fits without it
    assert "budget plan" in logged and "<- peak" in logged


def test_grpo_applies_the_plan_when_asked(tmp_path, capfd, fresh_accelerate_state):
    from trainer.engine.setup import start_run
    from trainer.grpo import GRPOArguments

    ctx = start_run(GRPOArguments, ["--config", "tests/configs/tiny_grpo.yaml", "--rollout_micro_batch_size", "2",
                                    "--output_dir", str(tmp_path / "on"), "--auto_fit", "true"], stage="grpo")
    assert ctx.stage_args.rollout_micro_batch_size == 16  # 4 prompts x 4 responses in one pass
    assert "budget plan" in "".join(capfd.readouterr())
