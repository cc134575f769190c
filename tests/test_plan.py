"""The online RL budget planner (profiling/plan.py): batch sizes and checkpointing chosen from the estimate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from foundation.cli import UsageError

from foundation.settings import PPOArguments
from profiling import components as C
from profiling.plan import OFFLOADS, offloads_allowed, plan_rl
from profiling.predict import EstimateArguments, estimate
from profiling.shapes import load_shape
from trainer.config import parse_config
from trainer.engine.setup import run_config

SEVEN_B = load_shape("llama-2-7b")
# trainer/configs/llama2_7b/ppo.yaml's settings (NF4, bf16, paged 8-bit AdamW, LoRA r=16 all-linear)
# decoding eagerly: the rules below hold for either path; test_decode_auto_* plans the path
RECIPE = EstimateArguments(stage="ppo", quantization="nf4", rollout_batch_size=16, rollout_micro_batch_size=16,
                           micro_batch_size=4, max_prompt_length=256, max_new_tokens=128, lora_dropout=0.0,
                           decode="eager")


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
@pytest.mark.parametrize("budget, rollout_rows, micro", [(24, 64, 16), (16, 32, 16), (12, 16, 8), (8, 4, 2)])
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
    # no value rows in the update: at 24 and 16 GB a micro-batch of 4 fits without recomputation, and that
    # is at least half of the 8 checkpointing would allow, so the recompute is not worth it
    (24, 16, 4, False), (16, 16, 4, False), (12, 16, 8, True), (8, 4, 4, True),
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


def test_auto_fit_is_off_on_cpu_by_default(tmp_path, capfd, fresh_accelerate_state):
    from foundation.settings import PPOArguments
    from trainer.engine.setup import start_run

    ctx = start_run(PPOArguments, ["--config", "tests/configs/tiny_ppo.yaml", "--rollout_micro_batch_size", "auto",
                                   "--output_dir", str(tmp_path)], stage="ppo")
    assert ctx.plan.rollout_micro_batch_size == 8  # auto, unplanned: the field's default
    assert ctx.plan.generation_weights == "quantized"  # auto, unplanned: decodes from the weights as they are
    assert ctx.plan.decode == "eager"  # auto, on the CPU
    assert ctx.plan.offload_embeddings is False and ctx.plan.offload_activations is False  # auto, unplanned
    table = "".join(capfd.readouterr())
    assert "budget plan" not in table
    assert "rollout_micro_batch_size 8  (planned)" in table and "offload_activations false  (planned)" in table
    assert "micro_batch_size 2  (set)" in table  # the config's


# a simulated budget of 0.05 GiB: the tiny model's plan is every rollout row in one pass and the whole
# minibatch per update micro-batch, without checkpointing
PLANNING = ["--config", "tests/configs/tiny_ppo.yaml", "--auto_fit", "true", "--memory_budget_gib", "0.05"]


def test_explicit_flags_survive_planning_and_the_same_flags_left_auto_are_planned(tmp_path, capfd,
                                                                                  fresh_accelerate_state):
    from foundation.settings import PPOArguments
    from trainer.engine.setup import start_run

    given = start_run(PPOArguments, [*PLANNING, "--gradient_checkpointing", "true", "--micro_batch_size", "2",
                                     "--output_dir", str(tmp_path / "given")], stage="ppo")
    table = "".join(capfd.readouterr())
    assert given.plan.gradient_checkpointing is True and given.plan.micro_batch_size == 2
    assert "gradient_checkpointing true  (set)" in table and "micro_batch_size 2  (set)" in table
    # the config's rollout_micro_batch_size 4 is given too
    assert given.plan.rollout_micro_batch_size == 4 and "rollout_micro_batch_size 4  (set)" in table

    auto = start_run(PPOArguments, [*PLANNING, "--gradient_checkpointing", "auto", "--micro_batch_size=auto",
                                    "--rollout_micro_batch_size", "auto", "--output_dir", str(tmp_path / "auto")],
                     stage="ppo")
    table = "".join(capfd.readouterr())
    assert auto.plan.gradient_checkpointing is False and auto.plan.micro_batch_size == 4
    assert auto.plan.rollout_micro_batch_size == 8
    assert "gradient_checkpointing false  (planned)" in table and "micro_batch_size 4  (planned)" in table
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert saved["plan"]["micro_batch_size"] == 4  # the run records what it runs with


def test_an_explicit_value_that_does_not_fit_stops_the_run_naming_it_and_the_phase(tmp_path, fresh_accelerate_state):
    from foundation.settings import PPOArguments
    from trainer.engine.budget import BudgetError
    from trainer.engine.setup import start_run

    with pytest.raises(BudgetError, match=r"--rollout_micro_batch_size 8 needs an estimated 0\.044 GiB in phase "
                                          r"'score', over memory_budget_gib=0\.04"):
        start_run(PPOArguments, [*PLANNING, "--memory_budget_gib", "0.04", "--rollout_micro_batch_size", "8",
                                 "--output_dir", str(tmp_path)], stage="ppo")
    assert not (tmp_path / "config.json").exists()  # stopped before anything was written


# --micro_batch_size 4 without checkpointing: its update needs 0.037 GiB, within a 0.04 GiB budget but not within
# the 10% margin (0.036 GiB); the rollout's 8 rows a pass need 0.044 GiB (phase score), 4 rows 0.035 GiB
TIGHT = [*PLANNING, "--micro_batch_size", "4", "--no_gradient_checkpointing", "--rollout_micro_batch_size", "auto"]


def test_a_given_value_that_fits_only_the_whole_budget_has_the_auto_fields_planned_around_it(tmp_path, capfd,
                                                                                           fresh_accelerate_state):
    """The planner keeps a 10% margin where it can; where nothing fits with it, it plans against the whole budget
    the start-up check accepts, so a field left auto is never refused where some value of it would start."""
    from profiling.predict import resolve_shape
    from trainer.engine.setup import start_run

    model, data, train, stage = parse_config(PPOArguments, [*TIGHT, "--memory_budget_gib", "0.04"])
    args = EstimateArguments.of_run(model, data, train, stage, stage="ppo", device="cpu")
    shape = resolve_shape(args)
    plan = plan_rl(shape, args, stage.mini_batch_size, planned={"rollout_micro_batch_size"})
    assert (plan.rollout_micro_batch_size, plan.micro_batch_size, plan.gradient_checkpointing) == (4, 4, False)
    assert plan.usable_bytes == plan.budget_bytes == args.budget_bytes  # the whole budget: the margin had no room
    assert int(0.9 * args.budget_bytes) < plan.peak_bytes <= args.budget_bytes and plan.peak_phase == "update"
    assert estimate(shape, replace(args, rollout_micro_batch_size=8))["peak_bytes"] > args.budget_bytes

    ctx = start_run(PPOArguments, [*TIGHT, "--memory_budget_gib", "0.04", "--output_dir", str(tmp_path)], stage="ppo")
    logs = "".join(capfd.readouterr())
    assert ctx.plan.rollout_micro_batch_size == 4 and "rollout_micro_batch_size 4  (planned)" in logs
    assert "memory estimate: peak 0.037 GiB (update) within the 0.040 GiB budget" in logs
    assert json.loads((tmp_path / "config.json").read_text())["plan"]["rollout_micro_batch_size"] == 4


def test_where_nothing_fits_the_error_names_the_given_setting_not_a_phase_left_auto(tmp_path, fresh_accelerate_state):
    from trainer.engine.budget import BudgetError
    from trainer.engine.setup import start_run

    with pytest.raises(BudgetError, match=r"^ppo: --micro_batch_size 4 with --gradient_checkpointing false needs an "
                                          r"estimated 0\.037 GiB in phase 'update', over memory_budget_gib=0\.035 "
                                          r".* to fit, in order: micro_batch_size 4 -> 2"):
        start_run(PPOArguments, [*TIGHT, "--memory_budget_gib", "0.035", "--output_dir", str(tmp_path)], stage="ppo")
    assert not (tmp_path / "config.json").exists()
    # all left auto and still nothing fits: the phase over the budget, with the least its settings can take
    from profiling.plan import what_does_not_fit

    what, phase, least, est = what_does_not_fit(SEVEN_B, replace(RECIPE, memory_budget_gib=3))
    assert (what, phase) == ("even micro_batch_size 1 with gradient_checkpointing true", "update")
    assert (least.rollout_micro_batch_size, least.micro_batch_size) == (1, 1) and est["peak_phase"] == "update"
    assert est["peak_bytes"] > 3 * 2**30


def test_no_keeping_the_configured_ones_warning_precedes_the_budget_error(tmp_path, capfd, fresh_accelerate_state):
    """The warning is for a run that goes on unchecked (check_budget false); before the one-line error it is noise."""
    from trainer.engine.budget import BudgetError
    from trainer.engine.setup import start_run

    nothing_fits = [*TIGHT, "--memory_budget_gib", "0.035"]
    with pytest.raises(BudgetError):
        start_run(PPOArguments, [*nothing_fits, "--output_dir", str(tmp_path / "checked")], stage="ppo")
    assert "keeping the configured ones" not in "".join(capfd.readouterr())
    ctx = start_run(PPOArguments, [*nothing_fits, "--check_budget", "false",
                                   "--output_dir", str(tmp_path / "unchecked")], stage="ppo")
    assert "nothing fits memory_budget_gib=0.035 with the settings given; keeping the configured ones" in \
        "".join(capfd.readouterr())
    assert (ctx.plan.micro_batch_size, ctx.plan.rollout_micro_batch_size) == (4, 8)  # auto: its default


def test_auto_in_a_config_file_leaves_the_field_to_the_planner(tmp_path, capfd, fresh_accelerate_state):
    from foundation.settings import PPOArguments
    from trainer.engine.setup import start_run

    config = tmp_path / "ppo.yaml"
    config.write_text(Path("tests/configs/tiny_ppo.yaml").read_text().replace("micro_batch_size: 2",
                                                                              "micro_batch_size: auto"))
    ctx = start_run(PPOArguments, ["--config", str(config), *PLANNING[2:], "--output_dir", str(tmp_path / "run")],
                    stage="ppo")
    assert ctx.plan.micro_batch_size == 4 and "micro_batch_size 4  (planned)" in "".join(capfd.readouterr())


def test_grpo_applies_the_plan_when_asked(tmp_path, capfd, fresh_accelerate_state):
    from foundation.settings import GRPOArguments
    from trainer.engine.setup import start_run

    ctx = start_run(GRPOArguments, ["--config", "tests/configs/tiny_grpo.yaml", "--rollout_micro_batch_size", "auto",
                                    "--output_dir", str(tmp_path / "on"), "--auto_fit", "true"], stage="grpo")
    assert ctx.plan.rollout_micro_batch_size == 16  # 4 prompts x 4 responses in one pass
    assert "budget plan" in "".join(capfd.readouterr())


def test_the_planner_keeps_the_settings_it_is_not_given_to_plan():
    args = replace(RECIPE, memory_budget_gib=24, gradient_checkpointing=False, micro_batch_size=2)
    plan = plan_rl(SEVEN_B, args, mini_batch_size=8, planned={"rollout_micro_batch_size"})
    assert (plan.gradient_checkpointing, plan.micro_batch_size) == (False, 2)
    assert "micro_batch_size 2  (set)" in plan.table() and "rollout_micro_batch_size 16  (planned)" in plan.table()
    assert plan_rl(SEVEN_B, replace(args, micro_batch_size=64), mini_batch_size=64, planned=()) is None


def test_with_the_activations_offloaded_the_planner_keeps_checkpointing():
    # the estimate is alike with and without checkpointing then, but without it every saved tensor crosses
    # to the host: the tie goes to checkpointing
    args = replace(GRPO, memory_budget_gib=24, offload_activations=True)
    alike = [estimate(SEVEN_B, replace(args, gradient_checkpointing=c, micro_batch_size=4))["peak_bytes"]
             for c in (True, False)]
    assert alike[0] == alike[1]
    plan = plan_rl(SEVEN_B, args, mini_batch_size=8, planned={"micro_batch_size", "gradient_checkpointing"})
    assert plan.gradient_checkpointing and plan.offload_activations


QWEN_7B = load_shape("qwen2.5-7b")  # untied 152k x 3584 embedding: 1 GiB in bf16
TRL_GRPO = EstimateArguments(model_name_or_path="qwen2.5-7b", stage="grpo", beta=0.0, reward_model=False,
                             rollout_batch_size=1, num_generations=8, max_new_tokens=256, max_prompt_length=256,
                             micro_batch_size=8, rollout_micro_batch_size=8, lora_r=32, lora_dropout=0.0)


def test_offloaded_embeddings_leave_the_card_only_where_untied_and_on_cuda():
    embedding = QWEN_7B.vocab_size * QWEN_7B.hidden_size * 2
    kept, offloaded = (estimate(QWEN_7B, a)["phases"][0]["components"]["base_other"]
                       for a in (TRL_GRPO, replace(TRL_GRPO, offload_embeddings=True)))
    assert kept - offloaded == embedding
    on_cpu = replace(TRL_GRPO, device="cpu", quantization="none", dtype="float32")
    assert estimate(QWEN_7B, on_cpu)["phases"] == estimate(QWEN_7B, replace(on_cpu, offload_embeddings=True))["phases"]
    tied = load_shape("smollm2-135m")
    small = replace(TRL_GRPO, model_name_or_path="smollm2-135m", decode="eager")  # auto: eager once offloaded
    assert tied.tie_word_embeddings
    assert estimate(tied, small)["phases"] == estimate(tied, replace(small, offload_embeddings=True))["phases"]


def test_the_planner_offloads_the_embedding_only_when_nothing_fits_without_it():
    no_room = None
    for budget in [x / 4 for x in range(24, 60)]:  # the first budget where only the offloaded embedding fits
        args = replace(TRL_GRPO, memory_budget_gib=budget)
        if plan_rl(QWEN_7B, args, 8, may_offload=()) is None and plan_rl(QWEN_7B, args, 8) is not None:
            no_room = args
            break
    assert no_room is not None
    plan = plan_rl(QWEN_7B, no_room, 8)
    assert plan.offload_embeddings and "offload_embeddings true" in plan.table()
    assert not plan.offload_activations  # the embedding alone was enough
    roomy = plan_rl(QWEN_7B, replace(TRL_GRPO, memory_budget_gib=24), 8)
    assert roomy is not None and not roomy.offload_embeddings and not roomy.offload_activations


def test_the_planner_offloads_activations_where_the_embedding_alone_is_not_enough():
    """Each offload alone, then both: the budget where only both fit gets both, and a run that may not offload
    the embedding (compiled decoding) gets the activations alone where they are enough."""
    both_only = None
    for budget in [x / 8 for x in range(48, 120)]:
        args = replace(TRL_GRPO, memory_budget_gib=budget)
        alone = [plan_rl(QWEN_7B, args, 8, may_offload=(name,)) for name in OFFLOADS]
        if all(p is None for p in alone) and plan_rl(QWEN_7B, args, 8) is not None:
            both_only = args
            break
    assert both_only is not None
    plan = plan_rl(QWEN_7B, both_only, 8)
    assert plan.offload_embeddings and plan.offload_activations and "offload_activations true" in plan.table()
    activations_only = plan_rl(QWEN_7B, both_only, 8, may_offload=("offload_activations",))
    assert activations_only is None
    on_cpu = replace(TRL_GRPO, device="cpu", quantization="none", dtype="float32")
    assert estimate(QWEN_7B, on_cpu)["phases"] == estimate(QWEN_7B, replace(on_cpu, offload_activations=True))["phases"]


def test_offloaded_activations_leave_the_update_s_kept_layer_inputs_in_host_memory():
    """With checkpointing the update keeps each layer's input and the final norm's fp32 input: offloaded,
    they sit in host memory and one layer's input at a time comes back to the card."""
    off, on = (next(p for p in estimate(QWEN_7B, a)["phases"] if p["phase"] == "update")
               for a in (TRL_GRPO, replace(TRL_GRPO, offload_activations=True)))
    tokens, h, layers = 8 * (256 + 256), QWEN_7B.hidden_size, QWEN_7B.num_layers
    host = tokens * (layers * 2 * h + 4 * h + 4)
    assert on["elsewhere"] == {"cpu": {C.ACTIVATIONS: host}} and "elsewhere" not in off
    assert off["peak_allocated"] - on["peak_allocated"] == host - tokens * 2 * h


def test_a_dense_copy_for_decoding_is_planned_where_auto_and_it_fits_never_past_the_budget():
    """generation_weights auto: after the batch sizes, the dense copy of the 4-bit weights that still fits
    (resident, else per rollout), else none; never on one row per pass (bitsandbytes' 4-bit kernel reads 4 bits
    a weight there), on the CPU, or where the run named its choice."""
    auto = replace(GRPO, generation_weights="auto")
    plan = plan_rl(SEVEN_B, replace(auto, memory_budget_gib=26), mini_batch_size=8)
    assert plan.generation_weights == "dequantized" and "generation_weights dequantized" in plan.table()
    given = plan_rl(SEVEN_B, replace(GRPO, memory_budget_gib=26, generation_weights="dequantized"), mini_batch_size=8)
    assert plan == replace(given, planned=given.planned | {"generation_weights"})  # the quantized plan's batches
    assert "generation_weights dequantized  (set)" in given.table()
    assert plan.peak_bytes <= plan.usable_bytes
    resident = estimate(SEVEN_B, replace(GRPO, memory_budget_gib=26, generation_weights="resident",
                                         micro_batch_size=plan.micro_batch_size, gradient_checkpointing=False))
    assert resident["peak_bytes"] > plan.usable_bytes  # the resident copy would not fit
    assert plan_rl(SEVEN_B, replace(auto, memory_budget_gib=48), mini_batch_size=8).generation_weights == "resident"
    for args in (replace(auto, memory_budget_gib=22), replace(auto, device="cpu"),
                 replace(GRPO, generation_weights="quantized")):
        assert plan_rl(SEVEN_B, args, mini_batch_size=1).generation_weights == "quantized", args
    one_row = plan_rl(SEVEN_B, replace(auto, rollout_micro_batch_size=1), mini_batch_size=1,
                      planned={"micro_batch_size", "gradient_checkpointing"})
    assert one_row.rollout_micro_batch_size == 1 and one_row.generation_weights == "quantized"


def test_a_finished_stage_is_reused_where_its_planned_settings_were_left_auto(tmp_path):
    from trainer.pipeline import check_finished_stage

    out = tmp_path / "ppo"
    out.mkdir()
    argv = ["--config", "tests/configs/tiny_ppo.yaml", "--micro_batch_size", "auto", "--generation_weights", "auto"]
    saved = run_config(*parse_config(PPOArguments, [*argv, "--micro_batch_size", "4"]), resolved={})
    saved["stage"]["generation_weights"] = "dequantized"  # what a plan picked
    (out / "config.json").write_text(json.dumps(saved))
    check_finished_stage("ppo", argv, out)  # left auto: the plan's values are not a change
    with pytest.raises(UsageError, match=r"train.micro_batch_size: 4 -> 2"):
        check_finished_stage("ppo", [*argv, "--micro_batch_size", "2"], out)


def test_a_planned_setting_left_auto_compares_on_resume_as_its_value_where_nothing_plans_it():
    """auto matches auto, and the value it takes where nothing plans it (what a config.json may record); another
    value is a change, and what a planner chose is compared in the plan section."""
    from trainer.engine.setup import resume_config_changes

    auto = {"model": {"offload_activations": "auto"}, "train": {"micro_batch_size": "auto"},
            "plan": {"micro_batch_size": 2}}
    unplanned = {"model": {"offload_activations": False}, "train": {"micro_batch_size": 4},
                 "plan": {"micro_batch_size": 2}}
    assert resume_config_changes(auto, auto) == resume_config_changes(auto, unplanned) == \
        resume_config_changes(unplanned, auto) == []
    other = {"model": {"offload_activations": True}, "train": {"micro_batch_size": 4}, "plan": {"micro_batch_size": 4}}
    assert resume_config_changes(auto, other) == ["model.offload_activations: 'auto' -> True",
                                                  "plan.micro_batch_size: 2 -> 4"]


@pytest.mark.parametrize("flags, value", [
    ([], 2),  # the config sets it
    (["--micro-batch-size", "auto"], "auto"), (["--micro_batch_size=auto"], "auto"), (["--micro_batch_size", "3"], 3),
])
def test_a_planned_field_is_auto_unless_a_value_is_given(flags, value):
    from foundation.cli import auto_fields

    model, _, train, stage = parse_config(PPOArguments, ["--config", "tests/configs/tiny_ppo.yaml", *flags,
                                                         "--no_gradient_checkpointing"])
    assert train.micro_batch_size == value
    assert auto_fields(train) == ({"micro_batch_size"} if value == "auto" else set())
    assert model.gradient_checkpointing is False and "gradient_checkpointing" not in auto_fields(model)
    assert stage.generation_weights == "auto" and "generation_weights" in auto_fields(stage)


def test_the_five_planned_fields_default_to_auto_from_flags_config_and_code_and_replace_keeps_it():
    from foundation.cli import AUTO, parse
    from foundation.settings import ModelArguments, TrainArguments

    five = {"gradient_checkpointing", "offload_embeddings", "offload_activations", "micro_batch_size",
            "rollout_micro_batch_size"}
    for settings in (parse([ModelArguments, TrainArguments, PPOArguments], []),
                     (ModelArguments(), TrainArguments(), PPOArguments())):
        assert {name: getattr(obj, name) for obj in settings for name in five if hasattr(obj, name)} == \
            dict.fromkeys(five, AUTO)
    (train,) = parse([TrainArguments], [], {"micro_batch_size": "auto", "max_steps": 3}, "run.yaml")  # YAML auto
    assert replace(train, learning_rate=1e-3).micro_batch_size == AUTO  # replace keeps it auto
    assert replace(TrainArguments(micro_batch_size=2), learning_rate=1e-3).micro_batch_size == 2
    model, _ = parse([ModelArguments, TrainArguments], ["--gradient_checkpointing", "--offload_embeddings", "false",
                                                        "--offload_activations", "true"])
    assert (model.gradient_checkpointing, model.offload_embeddings, model.offload_activations) == (True, False, True)


@pytest.mark.parametrize("argv, defaults, message", [
    (["--max_steps", "auto"], {}, "argument --max_steps/--max-steps: invalid int value: 'auto'"),
    ([], {"max_steps": "auto"}, "run.yaml: max_steps: 'auto' must be a whole number"),
    (["--micro_batch_size", "0"], {}, "--micro_batch_size 0: must be at least 1"),
    (["--micro_batch_size", "two"], {}, "argument --micro_batch_size/--micro-batch-size: invalid int value: 'two'"),
    ([], {"micro_batch_size": 2.5}, "run.yaml: micro_batch_size: 2.5 must be a whole number, or auto"),
])
def test_auto_is_refused_in_one_line_where_nothing_plans_the_field(argv, defaults, message):
    from foundation.cli import parse
    from foundation.settings import TrainArguments

    with pytest.raises(UsageError) as exc:
        parse([TrainArguments], argv, defaults, "run.yaml")
    assert str(exc.value) == message


def test_the_planned_fields_left_auto_take_their_unplanned_values_without_a_planner():
    """On the CPU, or with --auto_fit off: checkpointing on, no offloads, micro-batches of 4, rollout passes of 8,
    each marked planned; a value set is kept and marked set."""
    from foundation.run_plan import RunPlan
    from foundation.settings import ModelArguments, TrainArguments

    plan = RunPlan.of(ModelArguments(), TrainArguments(), PPOArguments(), quantization="none", dtype="float32")
    assert (plan.gradient_checkpointing, plan.offload_embeddings, plan.offload_activations, plan.micro_batch_size,
            plan.rollout_micro_batch_size) == (True, False, False, 4, 8)
    assert {"gradient_checkpointing", "offload_embeddings", "offload_activations", "micro_batch_size",
            "rollout_micro_batch_size"} <= plan.planned
    given = RunPlan.of(ModelArguments(gradient_checkpointing=False), TrainArguments(micro_batch_size=2))
    assert "gradient_checkpointing false  (set)" in given.table() and "micro_batch_size 2  (set)" in given.table()
    assert "offload_embeddings false  (planned)" in given.table()


def test_decode_auto_plans_the_compiled_step_where_it_keeps_half_the_rows_else_eager():
    """--decode auto on CUDA: the compiled step with its resident KV cache where the plan keeps at least half
    the rows per generate pass eager decoding gets (the 24 GB recipe: all of them), marked planned; eager where
    a compiled plan does not fit, or fits only where eager decoding keeps the margin the other would spend, and on
    the CPU; a path given is kept."""
    auto = replace(GRPO, decode="auto", generation_weights="quantized")
    plan = plan_rl(SEVEN_B, replace(auto, memory_budget_gib=24), mini_batch_size=8)
    assert plan.decode == "compiled" and "decode" in plan.planned and "decode compiled  (planned)" in plan.table()
    compiled_kv = estimate(SEVEN_B, replace(auto, memory_budget_gib=24, **plan.settings()))
    assert plan.phases == tuple((p["phase"], p["total"]) for p in compiled_kv["phases"])
    assert all(C.KV_CACHE in p["components"] for p in compiled_kv["phases"])  # held in every phase
    budgets = {}
    for budget in [x / 4 for x in range(20, 40)]:
        picks = {d: plan_rl(SEVEN_B, replace(auto, memory_budget_gib=budget, decode=d), mini_batch_size=8,
                            may_offload=offloads_allowed(d, compile_layers=False)) for d in ("compiled", "eager")}
        kept_margin = {d: p for d, p in picks.items() if p is not None and p.usable_bytes < p.budget_bytes}
        if kept_margin:  # a path that fits only the whole budget counts only where neither keeps the margin
            picks = {d: kept_margin.get(d) for d in picks}
        chosen = plan_rl(SEVEN_B, replace(auto, memory_budget_gib=budget), mini_batch_size=8)
        if picks["eager"] is None:
            assert chosen is None or chosen.decode == "compiled"
            continue
        halves = picks["compiled"] is not None and (
            2 * picks["compiled"].rollout_micro_batch_size >= picks["eager"].rollout_micro_batch_size)
        assert chosen.decode == ("compiled" if halves else "eager"), budget
        assert not (chosen.decode == "compiled" and chosen.offload_embeddings)
        budgets[chosen.decode] = budget
    assert set(budgets) == {"compiled", "eager"}  # both happen between 5 and 10 GB
    assert plan_rl(SEVEN_B, replace(auto, memory_budget_gib=24, decode="eager"), mini_batch_size=8).decode == "eager"
    assert plan_rl(load_shape("tiny-llama"), replace(auto, model_name_or_path="tiny-llama", device="cpu",
                                                     quantization="none"), mini_batch_size=8).decode == "eager"


def test_the_start_up_check_refuses_exactly_the_offloads_the_planner_never_turns_on():
    """One rule (`profiling.plan.offload_conflict`) decides both: an offload given that the run's other settings
    or launch rule out stops it at start, in one line naming it; one left auto is never planned there."""
    from itertools import product
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    from foundation.settings import ModelArguments
    from trainer.engine.launch import Launch, LaunchError
    from trainer.engine.settle import check_combinations

    seen = set()
    for decode, compiled_layers, fsdp in product(("auto", "eager", "compiled"), (False, True), (False, True)):
        accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP if fsdp else DistributedType.MULTI_GPU,
                                      state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={})),
                                      device=torch.device("cuda"))
        planned = offloads_allowed(decode, compiled_layers, sharded=Launch.of(accelerator).sharded is not None)
        for name in OFFLOADS:
            try:
                asked = ModelArguments(offload_embeddings=name == "offload_embeddings",
                                       offload_activations=name == "offload_activations", compile_layers=compiled_layers)
                check_combinations(asked, SimpleNamespace(decode=decode), Launch.of(accelerator))
                refused = False
            except LaunchError as exc:
                refused = str(exc).startswith(f"--{name} ")
                assert refused or str(exc).startswith("--compile_layers is not supported under FSDP"), exc
                assert "\n" not in str(exc)
            assert refused == (name not in planned), (name, decode, compiled_layers, fsdp)
            seen.add(refused)
    assert seen == {True, False}
