"""benchmarks/ppo_vs_trl: both sides do the same PPO work, and the report never invents a GPU figure."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ sits beside the installed packages, not inside them
    sys.path.insert(0, str(ROOT))

from benchmarks.report import render_markdown  # noqa: E402
from benchmarks.workload import Workload, head_weights, trl_batch_settings  # noqa: E402

TINY = ["--model_name_or_path", "tiny-llama", "--lora_r", "4", "--lora_alpha", "8", "--prompt_length", "16",
        "--max_new_tokens", "6", "--rollout_batch_size", "8", "--rollout_micro_batch_size", "4",
        "--mini_batch_size", "4", "--micro_batch_size", "2", "--ppo_epochs", "2", "--steps", "1",
        "--warmup_runs", "1"]


def test_the_benchmark_times_the_very_ppo_step_training_runs():
    import benchmarks.ours
    import trainer.ppo
    import trainer.rl.online

    assert benchmarks.ours.rl_step is trainer.rl.online.rl_step  # what train_online steps with
    assert benchmarks.ours.PPO is trainer.ppo.PPO
    args = Workload.parse(TINY)
    assert type(args.ppo) is trainer.ppo.PPOArguments  # training's own frozen settings object
    assert args.ppo.min_new_tokens == args.ppo.max_new_tokens == 6  # fixed-length responses


def test_our_side_plans_what_the_command_leaves_auto_as_the_stage_does():
    """Our side decodes as a run of the stage does: the settings the benchmark's command leaves auto (decode
    path, generation weights) go through the stage's budget plan (on with CUDA; here asked for), the ones it
    gives stay as given, so both sides do the same work."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from benchmarks.ours import as_the_stage_plans
    from profiling.plan import PLANNABLE

    cpu = SimpleNamespace(device=torch.device("cpu"), distributed_type=DistributedType.NO, state=SimpleNamespace())
    args = Workload.parse([*TINY, "--auto_fit", "true"])
    assert (args.ppo.decode, args.ppo.generation_weights) == ("auto", "auto")
    planned = as_the_stage_plans("ppo", args, cpu)
    assert planned.decode in ("eager", "compiled") and planned.generation_weights != "auto"
    assert (planned.micro_batch_size, planned.rollout_micro_batch_size, planned.gradient_checkpointing) == (
        args.micro_batch_size, args.rollout_micro_batch_size, args.model.gradient_checkpointing)
    assert not planned.planned & set(PLANNABLE)
    unplanned = as_the_stage_plans("ppo", Workload.parse(TINY), cpu)
    assert unplanned.decode == "eager"  # auto_fit off: as the stage on the CPU, auto decodes eagerly


def test_trl_batch_settings_reproduce_our_rollout_minibatch_and_micro_batch_sizes():
    args = Workload.parse(["--rollout_batch_size", "64", "--rollout_micro_batch_size", "16", "--mini_batch_size",
                           "16", "--micro_batch_size", "4", "--ppo_epochs", "3"])
    cfg = trl_batch_settings(args)
    # What trl.experimental.ppo.PPOTrainer.__init__ derives from them (world size 1):
    local_batch = cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"]
    assert local_batch == 64
    assert local_batch // cfg["num_mini_batches"] == 16
    assert cfg["per_device_train_batch_size"] == 4
    assert cfg["local_rollout_forward_batch_size"] == 16 and cfg["num_ppo_epochs"] == 3
    assert args.tokens() == {"generated": 64 * 16, "update": 64 * (32 + 16) * 3}


def test_trl_reward_and_value_models_compute_our_reward_and_initial_value_functions(tmp_path):
    """Same base weights + the same head weights: TRL's separate models score exactly as our adapters."""
    from benchmarks.ours import build_model
    from benchmarks.trl_ppo import add_value_lora, load_score_model
    from benchmarks.workload import write_heads
    from trainer.model.loading import load_tokenizer, model_plan

    args = Workload.parse(["--model_name_or_path", "tiny-llama", "--lora_r", "4", "--lora_alpha", "8"])
    tokenizer = load_tokenizer("tiny-llama")
    device = torch.device("cpu")
    heads = head_weights(64, args.model_seed)
    plan = model_plan(args.model, device)
    ours = build_model(args, plan, len(tokenizer), device, write_heads(heads, tmp_path))  # the benchmark's own loading
    reward, _ = load_score_model(args.model, len(tokenizer), device, heads["reward"])
    value, _ = load_score_model(args.model, len(tokenizer), device, heads["value"])
    add_value_lora(value, args)
    ids = torch.randint(3, 1000, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ours.eval()
    with torch.no_grad():
        ours_reward = ours(ids, mask, adapter="reward", output="scores")
        ours_value = ours(ids, mask, adapter="value", output="scores")
        trl_reward = reward.score(reward.model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)
        trl_value = value.score(value.model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)
    torch.testing.assert_close(trl_reward, ours_reward, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trl_value, ours_value, rtol=1e-5, atol=1e-5)
    value_trainable = sum(p.numel() for p in value.parameters() if p.requires_grad)
    ours_value_lora = sum(p.numel() for p, a in ours._lora_params if a == "value")
    assert value_trainable == ours_value_lora + 64  # its LoRA, the same shape as ours, and the bias-free score head


def _report(kind: str) -> dict:
    summary = {"step_s": 2.0, "rollout_s": 1.5, "generate_s": 1.0, "update_s": 0.5, "optimizer_steps": 2.0,
               "rollout_tokens_per_s": 10.0, "generate_tokens_per_s": 15.0, "update_tokens_per_s": 100.0,
               "peak_allocated_bytes": 2**30 if kind == "cuda" else None,
               "peak_reserved_bytes": 2**31 if kind == "cuda" else None,
               "peak_rss_bytes": None if kind == "cuda" else 3 * 2**30,
               "peak_rss_above_start_bytes": None if kind == "cuda" else 2**30}
    side = {"label": "x", "status": "ok", "error": None, "setup": {"trainable_parameters": 10}, "summary": summary}
    return {"device_kind": kind, "device": kind, "device_name": kind, "date": "d", "git_revision": "r",
            "command": "c", "versions": {"torch": "2"}, "trl_version": "1.12.0", "mixed_precision": "no",
            "simulated_gpu_gib": 24.0 if kind == "cuda" else None,
            "settings": {k: v for part in Workload.parse([]).settings().values() for k, v in part.items()},
            "sides": {"ours": side, "trl": side}, "ratios": {}}


def test_markdown_shows_allocator_peaks_on_gpu_and_resident_set_on_cpu_never_both():
    gpu, cpu = render_markdown(_report("cuda")), render_markdown(_report("cpu"))
    assert "| peak allocated (GiB) | 1.00 | 1.00 |" in gpu and "peak RSS" not in gpu and "CPU time" not in gpu
    assert "capped at 24 GiB" in gpu
    assert "| peak RSS, CPU (GiB) | 3.00 | 3.00 |" in cpu and "peak allocated" not in cpu
    assert "not GPU memory" in cpu and "process CPU time" in cpu


def test_collect_run_copies_reports_and_results_but_no_weights(tmp_path):
    from benchmarks.collect_run import collect

    run = tmp_path / "run"
    (run / "sft" / "adapter").mkdir(parents=True)
    (run / "sft" / "checkpoint-0000004").mkdir()
    (run / "sft" / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (run / "sft" / "results.json").write_text('{"stage": "sft"}')
    (run / "sft" / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "sft" / "evaluation-eval.json").write_text('{"task": "sft"}')
    (run / "report.md").write_text("# report")
    out = tmp_path / "out"
    collect(run, out, note="unit test")
    assert (out / "sft" / "results.json").read_text() == '{"stage": "sft"}'
    assert (out / "report.md").is_file() and (out / "sft" / "metrics.jsonl").is_file()
    assert not list(out.rglob("*.safetensors")) and not list(out.rglob("checkpoint-*"))
    info = json.loads((out / "provenance.json").read_text())
    assert info["note"] == "unit test" and info["git_revision"] and "sft/results.json" in info["files"]
    assert (out / "sft" / "evaluation-eval.json").read_text() == '{"task": "sft"}'  # evaluate --output_file


def _run(step_s: list[float], rss_start: int, rss_peaks: list[int], status: str = "ok") -> dict:
    steps = [{"step": i, "warmup": i == 0, "step_s": t, "rollout_s": t / 2, "update_s": t / 2, "generate_s": t / 4,
              "peak": {"peak_rss_bytes": peak}} for i, (t, peak) in enumerate(zip(step_s, rss_peaks))]
    return {"side": "x", "status": status, "error": None if status == "ok" else "boom", "steps": steps, "setup": {},
            "at_start": {"rss_bytes": rss_start}, "load_average_at_start": (1.0,), "load_average_at_end": (2.0,)}


def test_rounds_alternate_the_order_and_pool_every_rounds_measured_steps():
    from benchmarks.ppo_vs_trl import merge_round, round_orders, summarize

    assert round_orders(["ours", "trl"], 3) == [["ours", "trl"], ["trl", "ours"], ["ours", "trl"]]
    assert round_orders(["ours", "trl", "ours_eager_decode"], 2)[1] == ["ours_eager_decode", "trl", "ours"]
    tokens = {"generated": 10, "update": 100}
    # round 1: warm-up 9 s, then 2 s and 4 s; round 2 (started 1 GiB higher): warm-up, then 6 s
    side = merge_round(None, _run([9.0, 2.0, 4.0], 1 << 30, [3 << 30, 3 << 30, 3 << 30]), 1)
    side = merge_round(side, _run([9.0, 6.0], 2 << 30, [3 << 30, 5 << 30], status="failed"), 2)
    summary = summarize(side, tokens)
    assert summary["measured_steps"] == 3 and summary["step_s"] == 4.0  # (2 + 4 + 6) / 3, warm-ups left out
    assert summary["peak_rss_bytes"] == 5 << 30
    assert summary["peak_rss_above_start_bytes"] == 3 << 30  # 5 GiB over round 2's start of 2 GiB
    assert [s["round"] for s in side["steps"]] == [1, 1, 1, 2, 2]
    assert side["status"] == "failed" and side["error"] == "round 2: boom"
    assert [r["load_average_at_start"] for r in side["rounds"]] == [(1.0,), (1.0,)]


def test_markdown_lists_each_rounds_ratio_when_there_are_several():
    report = _report("cpu")
    report["settings"]["rounds"] = 2
    report["rounds"] = [{"round": 1, "order": ["ours", "trl"], "step_s": {"ours": 2.0, "trl": 3.0}},
                        {"round": 2, "order": ["trl", "ours"], "step_s": {"ours": 2.5, "trl": 2.5}}]
    text = render_markdown(report)
    assert "| 1 | ours, trl | 2.00 | 3.00 | 1.50x |" in text and "| 2 | trl, ours | 2.50 | 2.50 | 1.00x |" in text
    assert "in each of 2 rounds" in text
    report["rounds"] = report["rounds"][:1]
    assert "## Rounds" not in render_markdown(report)


def test_decode_times_each_decode_path_on_the_same_rows(tmp_path, traced_not_generated):
    """benchmarks.gpu.decode --paths (the speed part's decode, from the dense copy as it decodes, here the tiny preset
    on the CPU): one row per (path, weights, batch), each timing the rollouts' decode loop (compiled_whole: the
    compiled step without decoder-layer regions, beside it) against the bandwidth bound; a compiled first call's time
    is told apart by torch.compile's own timers (an eager one compiles nothing). Every (path, weights) of several
    --weights, in order: test_a_decode_no_longer_than_its_prefill_...; compiling from the 4-bit weights:
    tests/test_decode.py."""
    from benchmarks.gpu.decode import main as decode

    result = decode(["--model_name_or_path", "tiny-llama", "--batches", "2", "--prompt_tokens", "4", "--new_tokens",
                     "3", "--repeats", "1", "--copy_gib", "0.01", "--paths", "eager,compiled,compiled_whole",
                     "--weights", "dequantized", "--out_dir", str(tmp_path),
                     "--kernel_profile", str(tmp_path / "kernels")])
    assert [(r["path"], r["weights"], r["batch"]) for r in result["rows"]] == [
        (path, "dequantized", 2) for path in ("eager", "compiled", "compiled_whole")]
    assert all(r["tokens_per_s"] > 0 and r["first_call_s"] > 0 for r in result["rows"])
    assert all(0 < r["bandwidth_fraction"] < 1 for r in result["rows"])
    for row in result["rows"]:
        if row["path"] == "eager":
            assert row["first_call_compile_s"] == {}
        else:
            assert 0 < row["first_call_compile_s"]["_compile.compile_inner"] <= row["first_call_s"]
    assert result["bytes_per_decode_step"] > result["bytes_read_per_decode_step"]["base_weights"] > 0
    assert result["rows_planned"] == len(result["rows"]) and "stopped before" not in (tmp_path / "decode.md").read_text()
    from benchmarks.gpu.decode import markdown  # a run stopped part-way: its finished rows, said so
    assert "- rows: 2 of 3: the run stopped before the rest" in markdown({**result, "rows": result["rows"][:2]})
    assert "| compiled | dequantized | 2 |" in (tmp_path / "decode.md").read_text()
    profile = json.loads((tmp_path / "kernels" / "kernels.json").read_text())  # the first row's, decoded again
    assert profile["title"].startswith("decode, eager from dequantized weights, 2 rows")
    assert profile["profiled_phases"] == ["generate"] and profile["ops"] and profile["busy_s"] > 0


def test_ablations_change_the_model_or_ppo_setting_they_name_and_the_report_shows_each_variant():
    args = Workload.parse([*TINY, "--compile_layers", "true"])
    eager, eager_decode = args.ablation("ours_eager"), args.ablation("ours_eager_decode")
    assert eager.model.compile_layers is False and eager.ppo == args.ppo
    assert eager_decode.ppo.decode == "eager" and eager_decode.model == args.model
    assert args.ablation("trl_compiled") == args.ablation("trl") == args
    report = _report("cpu")
    slower = {**report["sides"]["ours"], "summary": {**report["sides"]["ours"]["summary"], "step_s": 3.0},
              "rounds": [{"compiled_graphs": 12}, {"compiled_graphs": 0}]}
    report["sides"].update(ours_eager=slower, trl_compiled=slower)
    report["sides"]["trl"] = {**report["sides"]["trl"], "rounds": [{"compiled_graphs": 0}]}
    text = render_markdown(report)
    assert "## Ablations of ours (same command, same work)" in text and "| | ours | ours_eager |" in text
    assert "## Variants of TRL's side (same command, same work)" in text and "| | trl | trl_compiled |" in text
    assert "| whole PPO step (s) | 2.00 | 3.00 |" in text
    assert "- graphs torch.compile compiled during the side: round 1 12, round 2 0" in text
    assert "- graphs torch.compile compiled during the side: none" in text


def test_the_compiled_variants_need_compile_layers_on():
    from foundation.cli import UsageError

    for side in ("ours_eager", "trl_compiled"):
        with pytest.raises(UsageError, match="compare against --compile_layers true"):
            Workload.parse([*TINY, "--sides", f"ours,{side}"]).check()
        Workload.parse([*TINY, "--sides", f"ours,{side}", "--compile_layers", "true"]).check()


def test_isolated_sides_rerun_this_command_for_one_side_once_and_a_failed_child_is_recorded(monkeypatch):
    """--isolate (the default) runs each side, each round, in a process of its own: the same command less
    the options the parent owns, plus --sides NAME --rounds 1; a child that dies leaves a failed record."""
    import subprocess

    import benchmarks.ppo_vs_trl as bench
    from benchmarks.processes import without_options

    argv = ["--model_name_or_path", "smollm2-135m", "--sides=ours,trl", "--rounds", "2", "--out_dir", "x",
            "--steps", "1"]
    assert without_options(argv, bench.ISOLATE_OWN) == ["--model_name_or_path", "smollm2-135m", "--steps", "1"]
    seen = []

    class Died:  # the child process, exiting with status 3 before it writes its record
        def __init__(self, command, cwd, start_new_session):
            seen.append(command)
            self.returncode, self.pid = 3, -1

        def wait(self, timeout=None):
            return self.returncode

    monkeypatch.setattr(subprocess, "Popen", Died)
    record = bench.side_runner(bench.Workload.parse(argv), argv, None, None)("trl")
    command = seen[0]
    assert command[1:3] == ["-m", "benchmarks.ppo_vs_trl"]
    assert command[3:7] == ["--model_name_or_path", "smollm2-135m", "--steps", "1"]
    assert command[7:13] == ["--sides", "trl", "--rounds", "1", "--isolate", "false"] and command[13] == "--side_run_out"
    assert record["status"] == "failed" and "status 3" in record["error"] and record["steps"] == []


def test_trl_grpo_recipe_keeps_each_label_and_estimates_trl_s_recipe_with_the_policy_alone(tmp_path):
    from benchmarks.trl_grpo_recipe import main

    main(["--label", "before", "--out_dir", str(tmp_path)])
    data = main(["--label", "after", "--out_dir", str(tmp_path)])
    assert list(data["runs"]) == ["before", "after"]  # a later label is added beside, never over, the first
    assert json.loads((tmp_path / "result.json").read_text())["runs"].keys() == {"before", "after"}
    recipes = data["runs"]["before"]["recipes"]
    assert set(recipes) == {"trl_grpo_prompt256", "trl_grpo_prompt128", "trl_grpo_prompt256_offload_embeddings",
                            "trl_grpo_prompt256_offload_activations", "trl_grpo_prompt256_offload_both", "seed_ppo"}
    trl = recipes["trl_grpo_prompt256"]["estimate"]
    held = {c for p in trl["phases"] for c in p["components"] if c.startswith(("adapter/", "head/"))}
    assert held == {"adapter/policy"}
    assert trl["config"]["settings"]["lora_r"] == 32 and trl["config"]["shape"]["vocab_size"] == 152064
    seed = recipes["seed_ppo"]["estimate"]["config"]["settings"]  # read off trainer/configs/llama2_7b/ppo.yaml
    assert (seed["rollout_batch_size"], seed["micro_batch_size"], seed["max_new_tokens"], seed["reward_model"]) == (
        16, 4, 128, True)
    summary = recipes["trl_grpo_prompt256"]["summary"]
    # the context the recipe names at the start, and the kernels the estimator assumes CUDA loads later
    assert summary["peak_gib"] - summary["peak_without_context_gib"] == pytest.approx(0.5 + 0.9)
    # the input embedding in host memory: its bf16 bytes, and the allocator overhead on them, off the peak
    offloaded = recipes["trl_grpo_prompt256_offload_embeddings"]["summary"]
    assert summary["peak_gib"] - offloaded["peak_gib"] == pytest.approx(152064 * 3584 * 2 * 1.05 / 2**30, abs=0.002)
    # the update's kept activations in host memory as well: a lower peak again
    both = recipes["trl_grpo_prompt256_offload_both"]["summary"]
    assert both["peak_gib"] < offloaded["peak_gib"] and both["peak_phase"] == "update"
    readme = (tmp_path / "README.md").read_text()
    assert "## before" in readme and "## after" in readme and "goal <= 8.9 GiB" in readme
    assert "| before | trl_grpo_prompt256 | update | 10.223 | 1.400 | 8.823 | no | no |" in readme


GRPO_TINY = ["--model_name_or_path", "tiny-llama", "--max_new_tokens", "4", "--num_generations", "2",
             "--rollout_batch_size", "2", "--mini_batch_size", "4", "--micro_batch_size", "2",
             "--rollout_micro_batch_size", "4", "--prompt_length", "16", "--lora_r", "4", "--lora_alpha", "8",
             "--scripted_reward", "chars:8"]


def test_grpo_vs_trl_runs_our_grpo_stage_and_trl_s_trainer_on_the_same_rows(tmp_path):
    """The smoke run of benchmarks.grpo_vs_trl (one process, the CPU): every side takes one optimizer step a
    step on 2 prompts x 2 completions, ours through the GRPO stage's own model and step (ours_4bit decoding
    from the 4-bit weights); the report holds each side's figures, each of ours over TRL's, and no GPU figure."""
    from benchmarks.grpo_vs_trl import GRPOWorkload, main

    args = GRPOWorkload.parse(GRPO_TINY)
    assert (args.beta, args.gradient_checkpointing, args.lora_dropout, args.min_new_tokens) == (0.0, True, 0.0, 4)
    assert GRPOWorkload.parse([]).lora_r == 32 and GRPOWorkload.parse([]).num_generations == 8  # TRL's recipe
    report = main([*GRPO_TINY, "--isolate", "false", "--sides", "ours,ours_4bit,trl", "--out_dir", str(tmp_path)])
    for name in ("ours", "ours_4bit", "trl"):
        side = report["sides"][name]
        assert side["status"] == "ok", side["error"]
        assert [s["warmup"] for s in side["steps"]] == [True, False]
        assert [s["optimizer_steps"] for s in side["steps"]] == [1, 1]
        summary = side["summary"]
        assert summary["step_s"] > 0 and summary["rollout_s"] > 0 and summary["update_s"] > 0
        assert summary["peak_allocated_bytes"] is None and summary["peak_rss_bytes"] > 0  # no CUDA here
    assert report["sides"]["trl"]["setup"]["grpo_config"]["generation_batch_size"] == 4  # the same 4 rows
    assert report["sides"]["ours"]["setup"]["step"].startswith("trainer.rl.online.rl_step")
    assert report["sides"]["ours_4bit"]["setup"]["generation"].endswith("from quantized weights (as the stage's "
                                                                         "budget plan picks them)")
    for side in ("ours", "ours_4bit"):
        assert report["ratios"][f"step_s_{side}_over_trl"] > 0
        assert report["ratios"][f"peak_reserved_bytes_{side}_over_trl"] is None
    text = (tmp_path / "grpo_vs_trl.md").read_text()
    assert "TRL GRPOTrainer" in text and "git revision" in text
    assert "\nours, decoding from the 4-bit weights (--generation_weights quantized) over TRL's: step " in text
    assert json.loads((tmp_path / "grpo_vs_trl.json").read_text())["kind"] == "grpo_vs_trl"


def test_a_decode_row_that_fails_is_said_and_the_others_are_timed(tmp_path, monkeypatch):
    """One (path, weights) that raises (a kernel or a compilation the device rejects) is listed with its error;
    the rows after it are still timed, and the run does not read as stopped."""
    import benchmarks.gpu.decode as bench

    timed = bench.time_generation

    def flaky(generator, ids, new_tokens, repeats):
        if generator.weights.choice == "quantized":
            raise RuntimeError("no kernel image is available\nfor execution on the device")
        return timed(generator, ids, new_tokens, repeats)

    monkeypatch.setattr(bench, "time_generation", flaky)
    result = bench.main(["--model_name_or_path", "tiny-llama", "--batches", "2", "--prompt_tokens", "4",
                         "--new_tokens", "3", "--repeats", "1", "--copy_gib", "0.01", "--paths", "eager",
                         "--weights", "quantized,dequantized", "--out_dir", str(tmp_path)])
    assert [(r["path"], r["weights"]) for r in result["rows"]] == [("eager", "dequantized")]
    assert result["failed"] == [{"path": "eager", "weights": "quantized", "batch": 2,
                                 "error": "RuntimeError: no kernel image is available for execution on the device"}]
    text = (tmp_path / "decode.md").read_text()
    assert "- eager from quantized weights at 2 rows failed: `RuntimeError: no kernel image" in text
    assert "stopped before" not in text


def test_a_decode_no_longer_than_its_prefill_is_listed_as_not_timed_not_given_a_figure(tmp_path, monkeypatch):
    """Decode time is the generation's less the prefill's: where noise makes the prefill the longer (too few new
    tokens on a busy machine), the row says so instead of a tokens/s made of a clamped difference. Every (path,
    weights) is tried, each path for the first weights, then for the next (nothing decodes here: no compilation)."""
    import benchmarks.gpu.decode as bench

    monkeypatch.setattr(bench, "time_generation", lambda generator, ids, new_tokens, *a: (0.5, 0.02))
    result = bench.main(["--model_name_or_path", "tiny-llama", "--batches", "2", "--prompt_tokens", "4",
                         "--new_tokens", "3", "--repeats", "1", "--copy_gib", "0.01", "--paths",
                         "eager,compiled,compiled_whole", "--weights", "quantized,dequantized",
                         "--out_dir", str(tmp_path)])
    assert result["rows"] == []
    assert result["failed"] == [{"path": path, "weights": weights, "batch": 2,
                                 "error": "not timed: generating 3 tokens (0.0200 s) took no longer than the prefill "
                                          "(0.0200 s); decode more tokens"}
                                for weights in ("quantized", "dequantized")
                                for path in ("eager", "compiled", "compiled_whole")]
    assert "stopped before" not in (tmp_path / "decode.md").read_text()


def test_kernel_profile_profiles_the_phases_named_and_ranks_their_ops(tmp_path):
    """`--kernel_profile`: every phase's wall time; the named phases' busy time (their nested phases' inside
    it) and their ops' own time, ranked; an unnamed phase's ops stay out of the profile (a 7B rollout's would
    outlast the step)."""
    from benchmarks.kernels import profile_step
    from trainer.engine.phases import phase

    a = torch.randn(64, 64)

    def step():
        with phase("generate"):
            torch.sin(a)
        with phase("update"):
            a @ a
            with phase("optimizer_step"):
                torch.cos(a)

    report = profile_step(step, torch.device("cpu"), tmp_path, "a test step", phases=("update",))
    ops = {op["op"]: op for op in report["ops"]}
    assert "aten::mm" in ops and "aten::cos" in ops and "aten::sin" not in ops
    assert ops["aten::mm"]["calls"] == 1 and report["busy_s"] >= ops["aten::mm"]["self_s"] > 0
    phases = {p["phase"]: p for p in report["phases"]}
    assert set(phases) == {"generate", "update", "optimizer_step"}
    assert phases["generate"]["ops_s"] is None and phases["optimizer_step"]["ops_s"] is None
    assert phases["update"]["ops_s"] == report["busy_s"] >= ops["aten::mm"]["self_s"] + ops["aten::cos"]["self_s"]
    assert report["wall_s"] >= phases["update"]["wall_s"] >= phases["optimizer_step"]["wall_s"]
    assert json.loads((tmp_path / "kernels.json").read_text()) == report
    text = (tmp_path / "kernels.md").read_text()
    assert "| `aten::mm` | 1 |" in text and "| generate |" in text and "aten::sin" not in text


def test_launches_counts_each_pass_per_layer_at_a_revision_and_a_routed_pass_launches_alike_for_any_groups(tmp_path):
    """`benchmarks.launches` at HEAD: operations per decoder layer of each RL pass, written as JSON and a table;
    PPO's scoring (3 row groups) launches what GRPO's (2) does, and an update launches more than a scoring. Per
    layer from 1 and 2 layers (`--layers 1,2`, the least to compile), not the default 2 and 4."""
    from benchmarks.launches import PASSES, main

    data = main(["HEAD", "--layers", "1,2", "--out_dir", str(tmp_path)])
    assert data["layers"] == "1,2" and data["command"].endswith("HEAD --layers 1,2")
    counts = data["revisions"][0]["per_layer"]
    assert set(counts) == set(PASSES) and all(n > 0 for n in counts.values())
    assert counts["ppo_scoring"] == counts["grpo_scoring"] < counts["grpo_update"] < counts["ppo_update"]
    assert json.loads((tmp_path / "result.json").read_text()) == data
    text = (tmp_path / "README.md").read_text()
    assert f"`{data['revisions'][0]['revision']}`" in text and f"| {counts['ppo_update']} |" in text
    assert "- layers: per layer from 1 and 2 layers" in text


def test_launches_counts_an_architecture_with_the_libraries_a_revision_names(tmp_path, monkeypatch):
    """REV@DIR puts DIR's libraries (another transformers) ahead of the environment's for that revision's count,
    --architecture builds the counted layers from that preset; where the revisions' library versions differ, the
    table's columns say which ran which, and the command line keeps what was asked."""
    import subprocess
    from contextlib import contextmanager

    from benchmarks import launches

    calls, real = [], subprocess.run

    @contextmanager
    def tree(revision):
        yield revision[:7], tmp_path / "tree"

    def counting(argv, **kwargs):
        if argv[1:3] != ["-c", launches.COUNTING]:  # git, for the run's provenance
            return real(argv, **kwargs)
        env = kwargs["env"]
        calls.append((argv[3:], env["PYTHONPATH"]))
        version = "5.17.0" if str(tmp_path / "old") in env["PYTHONPATH"] else "5.23.0"
        out = {"per_layer": {key: 1 for key in launches.PASSES},
               "versions": {"torch": "2.13.0", "transformers": version, "peft": "0.21.2"}}
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(launches, "revision_tree", tree)
    monkeypatch.setattr(launches.subprocess, "run", counting)
    data = launches.main([f"abcdef1@{tmp_path / 'old'}", "abcdef1", "--architecture", "qwen2",
                          "--out_dir", str(tmp_path / "out")])
    assert [argv for argv, _ in calls] == [[*launches.ARCHITECTURES["qwen2"], "2,4"]] * 2  # the default layers
    assert calls[0][1].split(os.pathsep) == [str(tmp_path / "tree"), str(tmp_path / "old")]
    assert calls[1][1] == str(tmp_path / "tree")
    assert data["architecture"] == "qwen2" and data["command"].endswith("abcdef1 --architecture qwen2")
    text = (tmp_path / "out" / "README.md").read_text()
    assert "| pass | `abcdef1` transformers 5.17.0 | `abcdef1` transformers 5.23.0 |" in text
    assert "- architecture: qwen2" in text and "- layers:" not in text
    from benchmarks.results_table import launches as row

    label = row(tmp_path / "out", data).benchmark  # the results table names the torch every column was counted under
    assert label == "operations launched per decoder layer (`benchmarks.launches`, qwen2, torch 2.13.0)"
