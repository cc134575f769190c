"""The GPU kit end to end in smoke mode: `benchmarks/gpu/run.sh --smoke` runs every part's code path on
the CPU with the tiny preset, packs each part into one archive small enough to come back from the GPU
machine, and `benchmarks.gpu.collect` files the archives and regenerates the GPU tables of docs/gpu-results.md.

The every-part smoke run (the tests marked `kit_smoke`, ~6 minutes on two cores) runs where the kit is used:
`make kit-smoke`, which benchmarks/gpu/prepare.sh runs before every GPU call. `make test` runs the rest: the
recipes by the kit's own stage commands in this process, the budget's cuts, collect, and each part's commands.

The smoke run's files are checked for what each part must measure: the flag ladder's rungs really ran
with their flags, both sides of the TRL comparison did the same work, decode throughput and the
estimator comparison were written.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# `speed` runs in smoke mode the code of `first`'s last two steps and the decode benchmark (tests/test_benchmarks.py
# times each decode path); its GPU-only steps are pinned below.
PARTS = ("first", "check", "memory", "ladder", "stages", "grpo_recipe")
FIRST_STEPS = ["gpu-tests", "sft+reward", "ppo", "vs-estimate", "ppo_vs_trl"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, Path]:
    """(archives folder, unpacked folder) of one smoke run of every part."""
    out = tmp_path_factory.mktemp("gpu-out")
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(["benchmarks/gpu/run.sh", "--smoke", *PARTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    unpacked = tmp_path_factory.mktemp("unpacked")
    for archive in out.glob("*.tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
    return out, unpacked


@pytest.mark.kit_smoke
def test_every_part_runs_and_packs_one_archive_that_can_come_back(smoke):
    out, unpacked = smoke
    archives = sorted(p.name for p in out.iterdir())
    assert archives == sorted(f"{part}-tiny-llama-smoke.tar.gz" for part in PARTS)
    for archive in out.iterdir():
        assert archive.stat().st_size < 16 * 2**20  # the device tool returns files up to 16 MiB
        with tarfile.open(archive) as tar:
            names = tar.getnames()
        assert not any(n.endswith((".safetensors", ".pt")) or "/checkpoint-" in n for n in names), archive
    for part in PARTS:
        manifest = json.loads((unpacked / part / "manifest.json").read_text())
        assert manifest["part"] == part and manifest["smoke"] is True and manifest["git_revision"]
        statuses = {s["name"]: s["status"] for s in manifest["steps"]}
        expected = {"nvidia-smi"} if part == "check" else set()  # no nvidia-smi on a CPU machine
        assert all(v == "ok" for k, v in statuses.items() if k not in expected), statuses
        assert manifest["seconds"] < manifest["budget_s"]
        assert "/work/" not in manifest["command"]


@pytest.mark.kit_smoke
def test_check_runs_the_gpu_tests_which_skip_without_cuda(smoke):
    _, unpacked = smoke
    report = (unpacked / "check" / "gpu-tests.xml").read_text()
    written = len(re.findall(r"^def test_", (ROOT / "tests" / "test_gpu.py").read_text(), re.M))
    ran = int(re.search(r'tests="(\d+)"', report).group(1))  # parametrized tests count once per case
    assert written >= 6 and ran >= written and f'skipped="{ran}"' in report
    versions = json.loads((unpacked / "check" / "versions.json").read_text())
    assert versions["torch"] and versions["bitsandbytes"] and versions["gpu"] is None


def assert_base_weights_as_estimated(compared: dict, stage: str) -> None:
    """A `benchmarks.gpu.vs_estimate` result of `stage` has phases, and in each the base's weights at ratio 1:
    tensor-counted components are exact closed forms of the estimator, on any device."""
    assert compared["phases"], stage
    for phase in compared["phases"]:
        rows = {r["component"]: r for r in phase["components"]}
        assert rows["base_weights"]["ratio"] == pytest.approx(1.0), (stage, phase["phase"])


@pytest.mark.kit_smoke
def test_memory_records_each_stage_and_compares_it_with_the_estimator(smoke):
    """The memory part's SFT, reward and GRPO runs (in smoke mode one process runs the three); its PPO run in smoke
    mode is the first call's (the same stage_run command, which the memory part leaves out there)."""
    from benchmarks.gpu.parts import PartArguments, steps_for

    _, unpacked = smoke
    runs = {"sft": unpacked / "memory" / "sft", "reward": unpacked / "memory" / "reward",
            "ppo": unpacked / "first" / "ppo", "grpo": unpacked / "memory" / "grpo"}
    for stage, run in runs.items():
        memory = json.loads((run / "memory.json").read_text())
        assert memory["phases"] and not memory["command"].startswith("/")
        assert_base_weights_as_estimated(json.loads((run / "vs_estimate.json").read_text()), stage)
    ppo = {p["phase"] for p in json.loads((runs["ppo"] / "vs_estimate.json").read_text())["phases"]}
    assert {"generate", "score", "update", "optimizer_step"} <= ppo  # fused passes: one scoring phase
    grpo = {p["phase"] for p in json.loads((runs["grpo"] / "vs_estimate.json").read_text())["phases"]}
    assert grpo == {"generate", "score", "update", "optimizer_step"}
    components = json.loads((runs["grpo"] / "memory.json").read_text())["phases"][-1]["components"]
    assert "adapter/value" not in components and "adapter/reward" in components  # three adapters, no critic
    config = json.loads((runs["ppo"] / "config.json").read_text())
    assert config["stage"]["min_new_tokens"] == config["stage"]["max_new_tokens"]  # fixed-length generation
    # on the GPU the memory part runs its own SFT, reward and 3 PPO steps, the PPO command the first call's but
    # for its step count, and compares all four with the estimator
    steps = steps_for(PartArguments(part="memory", out=str(unpacked)), unpacked)
    first = steps_for(PartArguments(part="first", out=str(unpacked)), unpacked, 1000.0)
    assert [s.name for s in steps] == ["sft", "reward", "ppo", "grpo", "vs-estimate"]
    ppo_argv, first_ppo = steps[2].argv, next(s for s in first if s.name == "ppo").argv
    assert ppo_argv[:-1] == first_ppo[:-1] and (ppo_argv[-2:], first_ppo[-2:]) == (["--max_steps", "3"],
                                                                                     ["--max_steps", "2"])
    assert steps[-1].argv[3:] == [str(unpacked / s) for s in ("sft", "reward", "ppo", "grpo")]


@pytest.mark.kit_smoke
def test_the_first_call_runs_its_steps_in_the_order_of_their_value(smoke):
    """One device call returns the headline figures: the CUDA path's tests, the seed recipe's PPO memory per
    component and phase against the estimator, decode at batch 16, then one PPO step against TRL's."""
    _, unpacked = smoke
    manifest = json.loads((unpacked / "first" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["steps"]] == FIRST_STEPS
    tests = (unpacked / "first" / "gpu-tests.xml").read_text()
    assert 0 < int(re.search(r'tests="(\d+)"', tests).group(1)) < len(re.findall(r"^def test_", (
        ROOT / "tests" / "test_gpu.py").read_text(), re.M))  # the subset the later steps do not prove
    memory = json.loads((unpacked / "first" / "ppo" / "memory.json").read_text())
    assert {"adapter/policy", "adapter/reference", "adapter/value", "adapter/reward"} <= set(
        memory["phases"][-1]["components"])  # the seed recipe's four adapters on one base
    phases = {p["phase"] for p in json.loads((unpacked / "first" / "ppo" / "vs_estimate.json").read_text())["phases"]}
    assert {"generate", "score", "update", "optimizer_step"} <= phases
    metrics = [json.loads(line) for line in (unpacked / "first" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in metrics) == 2


def test_a_first_call_out_of_time_records_the_later_steps_as_cut_and_still_comes_back(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # 14 s: time for the GPU tests (which skip here) and for no later step: those are cut
    proc = subprocess.run(["benchmarks/gpu/run.sh", "--smoke", "--budget_s", "14", "first"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (archive,) = out.glob("*.tar.gz")
    from benchmarks.gpu.collect import END, START, main

    readme = tmp_path / "README.md"
    readme.write_text(f"{START}\n{END}\n")
    (folder,) = main([str(archive), "--results_dir", str(tmp_path / "results"), "--readme", str(readme)])
    manifest = json.loads((folder / "manifest.json").read_text())
    statuses = [s["status"] for s in manifest["steps"]]
    assert [s["name"] for s in manifest["steps"]] == FIRST_STEPS and manifest["budget_s"] == 14
    assert manifest["versions"]["torch"] and statuses[-1] == "cut"  # versions in the manifest; TRL never reached
    assert set(statuses) <= {"ok", "cut"} and statuses == sorted(statuses, key=lambda s: s == "cut")


@pytest.mark.kit_smoke
def test_first_compares_with_trl_on_the_same_work_and_measures_decode(smoke):
    _, unpacked = smoke
    report = json.loads((unpacked / "first" / "ppo_vs_trl" / "ppo_vs_trl.json").read_text())
    assert report["tokens_per_step"] == {"generated": 4 * 6, "update": 4 * (16 + 6) * 2}
    for name in ("ours", "trl"):
        side = report["sides"][name]
        assert side["status"] == "ok", side["error"]
        assert [s["warmup"] for s in side["steps"]] == [True, False]
        assert all(s["response_tokens"] == 4 * 6 for s in side["steps"])  # min == max new tokens
        summary = side["summary"]
        assert summary["step_s"] > 0 and 0 < summary["generate_s"] < summary["rollout_s"]
        assert summary["peak_rss_bytes"] > 0 and summary["peak_allocated_bytes"] is None  # no CUDA here
    # One optimizer step per minibatch for ours; TRL 1.12 accumulates over the whole rollout: one per epoch.
    assert report["sides"]["ours"]["summary"]["optimizer_steps"] == 2 * 2
    assert report["sides"]["trl"]["summary"]["optimizer_steps"] == 2
    assert "trainer.rl.online.rl_step" in report["sides"]["ours"]["setup"]["step"]
    # Decode at the rollout's batch is the seed PPO run's own (no model built for it alone): every step's.
    metrics = [json.loads(line) for line in (unpacked / "first" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    decoded = [r["perf/decode_tokens_per_s"] for r in metrics if "perf/decode_tokens_per_s" in r]
    assert len(decoded) == 2 and all(v > 0 for v in decoded)
    # SFT and reward ran in one process, one step each, and left the adapters PPO started from.
    log = (unpacked / "first" / "logs" / "sft+reward.log").read_text()
    assert log.index("[sft]") < log.index("[reward]")
    for stage in ("sft", "reward"):
        assert json.loads((unpacked / "first" / stage / "results.json").read_text())["seconds"] > 0


def test_logs_and_the_manifest_name_no_folder_of_the_machine():
    """A step's log names the project's files from its root and a library's from its package (the kit's wheel
    installs, any site-packages), and the manifest shows the step's Python as `python`."""
    from benchmarks.gpu.parts import ROOT, interpreter_named, python, without_machine_folders

    log = (f"{ROOT}/trainer/sft.py:3\n/tmp/pinned/transformers/modeling_utils.py:3303: FutureWarning\n"
           '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/lowering.py", line 7836\n'
           ".venv/lib/python3.11/site-packages/peft/tuners/lora.py:1 and /tmp/site/bitsandbytes/x.py")
    assert without_machine_folders(log) == (
        "trainer/sft.py:3\ntransformers/modeling_utils.py:3303: FutureWarning\n"
        '  File "torch/_inductor/lowering.py", line 7836\npeft/tuners/lora.py:1 and bitsandbytes/x.py')
    assert interpreter_named([python(), "-m", "benchmarks.gpu.decode"]) == ["python", "-m", "benchmarks.gpu.decode"]
    assert interpreter_named(["nvidia-smi"]) == ["nvidia-smi"]


def test_a_side_out_of_time_is_recorded_as_cut_not_as_a_result(tmp_path):
    """--stop_at (the kit's deadline): a side the time does not reach is cut, and the report still comes back;
    with every side cut the command exits EXIT_CUT, which the kit counts as a cut step, not a finished one (so
    collecting the part keeps the last run that measured)."""
    import time

    from benchmarks.gpu.parts import CUT, Step, run_steps

    out = tmp_path / "cmp"
    argv = [sys.executable, "-m", "benchmarks.ppo_vs_trl", "--model_name_or_path", "tiny-llama",
            "--sides", "ours,trl", "--stop_at", f"{time.time() - 1:.0f}", "--out_dir", str(out)]
    step = Step("ppo_vs_trl", argv)
    run_steps([step], tmp_path, deadline=time.time() + 300)
    assert step.status == CUT, step.tail
    assert "no figure" in step.tail
    report = json.loads((out / "ppo_vs_trl.json").read_text())
    assert {name: side["status"] for name, side in report["sides"].items()} == {"ours": "cut", "trl": "cut"}
    assert not any(report["sides"][name]["steps"] for name in ("ours", "trl"))
    assert "status cut" in (out / "ppo_vs_trl.md").read_text()


@pytest.mark.kit_smoke
def test_stages_compare_dpo_with_trl_on_the_planned_rows(smoke, tmp_path):
    """The smoke run's stages part is DPO only, and CI's one run of the DPO comparison (SFT and reward with the
    same flags: tests/test_stages_vs_trl.py): both sides train on the planned rows, the same tensor walk counts
    the same gradients and optimizer states on both, and one evaluation scores both. On the GPU the part runs all
    three stages on random weights: speed and memory only."""
    from benchmarks.gpu.parts import PartArguments, steps_for
    from foundation.provenance import shown_command

    _, unpacked = smoke
    assert sorted(p.name for p in (unpacked / "stages").glob("stages_vs_trl-*")) == ["stages_vs_trl-dpo"]
    out = unpacked / "stages" / "stages_vs_trl-dpo"
    report = json.loads((out / "stages_vs_trl.json").read_text())
    assert report["stage"] == "dpo" and report["rows"]["train_rows"] == 2 * 2
    ours, trl = report["sides"]["ours"], report["sides"]["trl"]
    for side in (ours, trl):
        assert side["status"] == "ok", side["error"]
        assert side["rows_as_planned"] is True  # every micro-batch held the planned rows, in order
        assert [s["step"] for s in side["steps"]] == [1, 2]
        summary = side["summary"]
        assert summary["measured_steps"] == 1 and summary["step_s"] > 0 and summary["tokens_per_s"] > 0
        assert summary["peak_rss_bytes"] > 0
    # the same walk on both sides: the same LoRA shape and optimizer give the same gradients and states (ours
    # keeps its largest forward_backward, with these rows the second step's: after the first optimizer step)
    mine, theirs = ours["memory"]["resident"], trl["memory"]["resident"]
    assert mine["gradients"] == theirs["gradients"] > 0
    assert mine["optimizer_states"] == theirs["optimizer_states"] > 0
    assert ours["memory"]["saved_for_backward"] > 0 and trl["memory"]["saved_for_backward"] > 0
    assert "## Tensor-counted memory" in (out / "stages_vs_trl.md").read_text()
    assert ours["evaluation"]["pairs"] == trl["evaluation"]["pairs"] > 0  # the same held-out pairs for both
    for side in (ours, trl):
        low, high = side["evaluation"]["accuracy_ci95"]
        assert low <= side["evaluation"]["rewards/accuracies"] <= high and low < high
    tokens = report["rows"]["tokens_per_step"]
    assert len(tokens) == len(ours["computed_tokens_per_step"]) == len(trl["computed_tokens_per_step"]) == 2
    assert all(c >= t for c, t in zip(trl["computed_tokens_per_step"], tokens))  # rows x the longest row
    assert sum(ours["computed_tokens_per_step"]) < sum(trl["computed_tokens_per_step"])  # the prompt once a pair
    assert report["ratios"]["step_time_speedup"] > 0
    assert report["command"].startswith("python -m benchmarks.stages_vs_trl ") and "--stage dpo" in report["command"]
    assert shown_command(report).endswith(report["command"])
    assert f"- command: `{shown_command(report)}`" in (out / "stages_vs_trl.md").read_text()  # settings first
    gpu = [s.argv for s in steps_for(PartArguments(part="stages", out=str(tmp_path)), tmp_path)]
    assert [argv[argv.index("--stage") + 1] for argv in gpu] == ["sft", "reward", "dpo"]
    assert all(argv[argv.index("--evaluate") + 1] == "false" and "--profile_memory" not in argv for argv in gpu)


@pytest.mark.kit_smoke
def test_the_flag_ladder_ran_each_rung_with_its_flag(smoke):
    """Read what each rung's own run wrote, not the ladder's settings."""
    _, unpacked = smoke
    bench = unpacked / "ladder" / "ladder"
    data = json.loads((bench / "bench.json").read_text())
    status = {r["name"]: r["status"] for r in data["rows"]}
    assert status["+ flash_attention_2"] == "skipped"  # needs CUDA
    runs = {r["name"]: bench / "runs" / f"{i:02d}" for i, r in enumerate(data["rows"]) if r["status"] == "ok"}
    assert len(runs) == 5, status

    def phase(name: str) -> dict:
        memory = json.loads((runs[name] / "memory.json").read_text())
        return next(p for p in memory["phases"] if p["phase"] == "forward_backward")

    baseline, sdpa = phase(next(iter(runs))), phase("+ SDPA attention")
    ckpt, nf4, adam8 = phase("+ gradient checkpointing"), phase("+ 4-bit NF4 base"), phase("+ paged 8-bit AdamW")
    # eager attention saves its (B, heads, T, T) probabilities for backward; SDPA does not keep them
    assert sdpa["saved_for_backward"] < baseline["saved_for_backward"]
    # checkpointing keeps each layer's input only (on the tiny model the LM head's logits, which it
    # does not touch, are most of what is saved)
    assert ckpt["saved_for_backward"] < 0.9 * sdpa["saved_for_backward"]
    # the NF4 base holds packed 4-bit weights and their quantization constants; full precision has neither
    assert "base_quant_constants" not in ckpt["components"] and nf4["components"]["base_quant_constants"] > 0
    assert nf4["components"]["base_weights"] < 0.2 * ckpt["components"]["base_weights"]
    # 8-bit AdamW states: 2 bytes per parameter plus block statistics, against fp32 AdamW's 8 (r=64)
    assert adam8["components"]["optimizer_states"] < 0.35 * nf4["components"]["optimizer_states"]
    for row in data["rows"]:
        if row["status"] == "ok":
            assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_allocated_bytes"] is None


@pytest.mark.kit_smoke
def test_collect_files_the_archives_and_regenerates_the_readme_section(smoke, tmp_path):
    from benchmarks.gpu.collect import END, START, main

    out, _ = smoke
    results, readme = tmp_path / "results", tmp_path / "README.md"
    readme.write_text(f"# x\n\n{START}\nold\n{END}\n\nrest\n")
    folders = main([*map(str, sorted(out.glob("*.tar.gz"))), "--results_dir", str(results), "--readme", str(readme)])
    assert sorted(f.name for f in folders) == sorted(f"{p}-tiny-llama-smoke" for p in PARTS)
    info = json.loads((results / "memory-tiny-llama-smoke" / "provenance.json").read_text())
    assert info["device_name"] and info["date"] and info["git_revision"]
    assert info["steps"]["sft+reward+grpo"]["status"] == "ok"
    text = readme.read_text()
    assert "No GPU run has been collected yet" in text and "old" not in text and text.endswith("rest\n")
    # A GPU result (here: the smoke folder relabelled) is tabulated from its files.
    gpu = results / "memory-llama-2-7b-nvidia-h100"
    shutil.copytree(results / "memory-tiny-llama-smoke", gpu)
    info.update(smoke=False, device="cuda")
    (gpu / "provenance.json").write_text(json.dumps(info))
    from benchmarks.gpu.collect import update_readme

    update_readme(readme, results)
    text = readme.read_text()
    assert "| memory-llama-2-7b-nvidia-h100 | grpo | update |" in text
    compared = json.loads((gpu / "grpo" / "vs_estimate.json").read_text())
    update = next(p for p in compared["phases"] if p["phase"] == "update")
    row = text.split("| memory-llama-2-7b-nvidia-h100 | grpo | update |")[-1].split("\n")[0]
    assert f"{update['predicted_total'] / 2**30:.2f}" in row
    assert row.count("|") == 6  # peak allocated, its estimate and ratio, then the whole phase's three
    # The first call's folder: its PPO memory, decode speed and the comparison with TRL are tabulated too.
    first = results / "first-llama-2-7b-nvidia-h100"
    shutil.copytree(results / "first-tiny-llama-smoke", first)
    first_info = json.loads((first / "provenance.json").read_text())
    (first / "provenance.json").write_text(json.dumps({**first_info, "smoke": False, "device": "cuda"}))
    update_readme(readme, results)
    text = readme.read_text()
    assert "| first-llama-2-7b-nvidia-h100 | ppo | update |" in text
    assert "| first-llama-2-7b-nvidia-h100 | ppo | 4 | 8 |" in text  # rows decoded together, new tokens
    assert "| first-llama-2-7b-nvidia-h100 | ours | ok |" in text and "| first-llama-2-7b-nvidia-h100 | trl | ok |" in text
    # Every run folder of a result is tabulated (the recipe's offloaded run too), and the speed part's decode
    # paths (from its committed smoke result).
    recipe, speed = results / "grpo_recipe-llama-2-7b-nvidia-h100", results / "speed-llama-2-7b-nvidia-h100"
    shutil.copytree(results / "grpo_recipe-tiny-llama-smoke", recipe)
    shutil.copytree(ROOT / "tests" / "fixtures" / "kit" / "speed-tiny-llama-smoke", speed)
    for folder in (recipe, speed):
        part_info = json.loads((folder / "provenance.json").read_text())
        (folder / "provenance.json").write_text(json.dumps({**part_info, "smoke": False, "device": "cuda"}))
    update_readme(readme, results)
    text = readme.read_text()
    assert "| grpo_recipe-llama-2-7b-nvidia-h100 | grpo | update |" in text
    assert "| grpo_recipe-llama-2-7b-nvidia-h100 | grpo_8gb | update |" in text
    decoded = json.loads(next(speed.glob("*/decode.json")).read_text())["rows"]
    assert text.count("| speed-llama-2-7b-nvidia-h100 | decode |") == len(decoded) > 0
    assert "| speed-llama-2-7b-nvidia-h100 | grpo | update |" in text  # the speed part's GRPO run: memory, estimate
    # a kernel profile (`--kernel_profile`, here of a CPU step) beside a result is tabulated with it
    import torch

    from benchmarks.kernels import profile_step
    from trainer.engine.phases import phase

    def step():
        with phase("generate"):
            torch.ones(8, 8) @ torch.ones(8, 8)

    profile_step(step, torch.device("cpu"), speed / "decode" / "kernels", "a step", phases=("generate",))
    update_readme(readme, results)
    assert "| speed-llama-2-7b-nvidia-h100 | decode/kernels | generate |" in readme.read_text()


def test_the_speed_part_runs_the_recipes_as_the_stages_decode_then_each_decode_path(tmp_path):
    """The speed part: TRL's GRPO recipe as the stage runs it (--decode and --generation_weights left to the
    planner), 3 steps, and its memory against the estimate; decode alone, the compiled step from a dense copy at
    the recipes' 16 rows and 1 (one build), the 16 rows' step profiled; on the GPU only, the first call's PPO
    comparison with TRL (ours decoding as the stage does, its layers compiled for the update); last, decode
    alone at the GRPO recipe's shape (its model, adapter rank, rows and lengths), profiled."""
    from benchmarks.gpu.parts import PartArguments, grpo_recipe_run, steps_for
    from foundation.settings import DECODE_PATHS

    def flag(argv, name):  # argparse keeps a flag's last value
        return argv[len(argv) - 1 - argv[::-1].index(name) + 1]

    smoke = steps_for(PartArguments(part="speed", out=str(tmp_path), smoke=True), tmp_path)
    assert [s.name for s in smoke] == ["grpo", "vs-estimate", "decode", "decode-grpo"]  # ppo_vs_trl: the first call's
    steps = steps_for(PartArguments(part="speed", out=str(tmp_path)), tmp_path, deadline=1000.0)
    assert [s.name for s in steps] == ["grpo", "vs-estimate", "decode", "ppo_vs_trl", "decode-grpo"]
    argv = steps[2].argv
    assert argv[argv.index("--paths") + 1] == "compiled" and "compiled" in DECODE_PATHS
    assert argv[argv.index("--weights") + 1] == "dequantized"
    assert argv[argv.index("--batches") + 1] == "16,1"
    assert argv[argv.index("--kernel_profile") + 1] == str(tmp_path / "decode" / "kernels")  # the 16 rows' step
    recipe = grpo_recipe_run(PartArguments(part="grpo_recipe", out=str(tmp_path)), tmp_path, "grpo")
    assert steps[0].argv == [*recipe, "--max_steps", "3"] and flag(recipe, "--max_steps") == "2"
    assert "--decode" not in recipe and "--generation_weights" not in recipe
    assert steps[1].argv[-1] == str(tmp_path / "grpo")
    decode = steps[4].argv  # the recipe's decode: its model, rank, rows, prompt and response lengths
    for name in ("--model_name_or_path", "--quantization", "--attn_implementation", "--lora_r", "--lora_alpha"):
        assert flag(decode, name) == flag(recipe, name), name
    assert (flag(decode, "--batches"), flag(decode, "--prompt_tokens"), flag(decode, "--new_tokens")) == (
        flag(recipe, "--rollout_micro_batch_size"), flag(recipe, "--max_prompt_length"), flag(recipe, "--max_new_tokens"))
    assert flag(decode, "--paths") == "compiled" and flag(decode, "--weights") == "dequantized"
    assert flag(decode, "--kernel_profile") == str(tmp_path / "decode_grpo" / "kernels")
    main = next(s for s in steps_for(PartArguments(part="first", out=str(tmp_path)), tmp_path, 1000.0)
                if s.name == "ppo_vs_trl").argv
    speed = steps[3].argv
    at = speed.index("--compile_layers")  # ours compiled for the update, beside TRL
    assert speed[at:at + 4] == ["--compile_layers", "true", "--sides", "ours,trl"]
    speed = speed[:at] + speed[at + 4:]
    main = main[:main.index("--sides")] + main[main.index("--sides") + 2:]
    assert speed[:speed.index("--out_dir")] == main[:main.index("--out_dir")]  # the same work


@pytest.mark.kit_smoke
def test_the_grpo_recipe_part_runs_trl_s_recipe_with_the_policy_adapter_alone(smoke):
    """TRL's QLoRA GRPO recipe (issue 36): beta 0 and a scored reward, so one adapter on the base; memory against
    the estimator, which predicts it (`benchmarks.trl_grpo_recipe`)."""
    from benchmarks.gpu.parts import PartArguments, steps_for

    _, unpacked = smoke
    memory = json.loads((unpacked / "grpo_recipe" / "grpo" / "memory.json").read_text())
    assert {k for p in memory["phases"] for k in p["components"] if k.startswith("adapter")} == {"adapter/policy"}
    assert json.loads((unpacked / "grpo_recipe" / "grpo" / "vs_estimate.json").read_text())["phases"]
    assert json.loads((unpacked / "grpo_recipe" / "grpo_8gb" / "vs_estimate.json").read_text())["phases"]
    run, _, small, _ = steps_for(PartArguments(part="grpo_recipe", out=str(unpacked)), unpacked)  # on the GPU
    flags = run.argv
    for flag, value in (("--model_name_or_path", "qwen2.5-7b"), ("--lora_r", "32"), ("--num_generations", "8"),
                        ("--max_new_tokens", "256"), ("--micro_batch_size", "8"), ("--beta", "0"),
                        ("--optimizer", "paged_adamw_8bit"), ("--simulate_gpu_gib", "24")):
        assert flags[flags.index(flag) + 1] == value, flag
    # the same recipe under an 8 GB cap and budget, its micro-batches (and offloads) left to the planner
    planned = ("--micro_batch_size", "8", "--rollout_micro_batch_size", "8")
    at = flags.index("--micro_batch_size")
    assert flags[at:at + 4] == list(planned)
    same = flags[:at] + flags[at + 4:]
    assert [a.replace("grpo_8gb", "grpo") for a in small.argv[:len(same)]] == same
    assert small.argv[len(same):] == ["--simulate_gpu_gib", "8", "--memory_budget_gib", "8"]


def test_each_recipe_runs_by_the_kit_s_stage_command_and_its_memory_meets_the_estimator(tmp_path, monkeypatch):
    """make test's run of the kit's stage commands, in this process: each trainer/configs/llama2_7b recipe by the
    command the kit's smoke run gives it (`parts.stage_run`: two steps on the tiny preset in NF4, memory recorded),
    the RL and DPO stages from the SFT and reward adapters before them; then `benchmarks.gpu.vs_estimate` sets the
    estimator beside every record."""
    from conftest import in_process_command

    from benchmarks.gpu.parts import PartArguments, stage_run
    from benchmarks.gpu.vs_estimate import main as vs_estimate

    monkeypatch.chdir(ROOT)  # the kit's commands name the recipes and the rows from the project's root
    adapters = ["--sft_adapter", str(tmp_path / "sft" / "adapter"), "--reward_adapter",
                str(tmp_path / "reward" / "adapter")]
    rollout = ["--eval_prompts", "0", "--max_new_tokens", "8", "--min_new_tokens", "8", "--rollout_batch_size", "2",
               "--rollout_micro_batch_size", "4", "--mini_batch_size", "2"]
    runs = {"sft": [], "reward": adapters[:2], "ppo": [*adapters, *rollout],
            "grpo": [*adapters, *rollout, "--num_generations", "2"], "dpo": adapters[:2]}
    smoke = PartArguments(part="memory", out=str(tmp_path), smoke=True)
    for stage, extra in runs.items():
        argv = stage_run(smoke, stage, tmp_path, *extra)
        assert argv[1:4] == [f"trainer/{stage}.py", "--config", f"trainer/configs/llama2_7b/{stage}.yaml"]
        proc = in_process_command(f"trainer.{stage}", argv[2:])
        assert proc.returncode == 0, (stage, proc.stdout[-2000:] + proc.stderr[-2000:])
        metrics = [json.loads(line) for line in (tmp_path / stage / "metrics.jsonl").read_text().splitlines()]
        assert max(r.get("step", 0) for r in metrics) == 2, stage
    compared = {r["run"]: r for r in vs_estimate([str(tmp_path / stage) for stage in runs])}
    assert sorted(compared) == sorted(runs)
    for stage in runs:
        assert_base_weights_as_estimated(compared[stage], stage)
    components = json.loads((tmp_path / "ppo" / "memory.json").read_text())["phases"][-1]["components"]
    assert {"adapter/policy", "adapter/reference", "adapter/value", "adapter/reward"} <= set(components)


# ---- collect: archives and manifests it refuses ---------------------------------------------------

GOOD_MANIFEST = {"part": "memory", "model": "llama-2-7b", "smoke": False, "device": "cuda", "device_slug": "nvidia-h100",
                 "steps": [{"name": "ppo", "status": "ok", "seconds": 12.34}]}


def add_member(tar: tarfile.TarFile, name: str, data: bytes = b"", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if not attrs else 0
    for key, value in attrs.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if not attrs else None)


def part_archive(path: Path, manifest: object, extra=()) -> Path:
    """A part's archive as run.sh packs it: PART/manifest.json (`manifest` as JSON, or bytes as they are), one
    result file, and `extra` (name, data, attrs) members."""
    data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    with tarfile.open(path, "w:gz") as tar:
        add_member(tar, "memory/manifest.json", data)
        add_member(tar, "memory/ppo/memory.json", b'{"phases": []}')
        for name, payload, attrs in extra:
            add_member(tar, name, payload, **attrs)
    return path


@pytest.fixture
def lab(tmp_path) -> tuple[Path, Path, Path]:
    """(results folder, README, a folder beside the results that a `../` or absolute name would hit)."""
    results, readme = tmp_path / "lab" / "results", tmp_path / "lab" / "README.md"
    victim = tmp_path / "lab" / "victim-llama-2-7b-nvidia-h100"
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("mine")
    readme.write_text("<!-- gpu-results:start -->\nold\n<!-- gpu-results:end -->\n")
    return results, readme, victim


def collect_exit(capsys, *argv: str) -> tuple[int, list[str]]:
    from benchmarks.gpu.collect import main
    from foundation.cli import run

    with pytest.raises(SystemExit) as stop:
        run(main, list(argv))
    return stop.value.code, capsys.readouterr().err.strip().splitlines()


def assert_nothing_touched(lab) -> None:
    results, readme, victim = lab
    assert not results.exists()
    assert (victim / "keep.txt").read_text() == "mine" and [p.name for p in victim.iterdir()] == ["keep.txt"]
    assert readme.read_text() == "<!-- gpu-results:start -->\nold\n<!-- gpu-results:end -->\n"


BAD_MANIFESTS = {
    "part-climbs-out": ({**GOOD_MANIFEST, "part": "../victim"}, "manifest.json's 'part' must be a plain name"),
    "part-absolute": ({**GOOD_MANIFEST, "part": "ABSOLUTE"}, "manifest.json's 'part' must be a plain name"),
    "model-missing": ({k: v for k, v in GOOD_MANIFEST.items() if k != "model"},
                      "manifest.json's 'model' must be a plain name"),
    "part-not-text": ({**GOOD_MANIFEST, "part": 7}, "manifest.json's 'part' must be a plain name"),
    "slug-with-slash": ({**GOOD_MANIFEST, "device_slug": "nvidia/../../x"},
                        "manifest.json's 'device_slug' must be a plain name"),
    "smoke-not-bool": ({**GOOD_MANIFEST, "smoke": "no"}, "manifest.json's 'smoke' must be true or false"),
    "steps-missing": ({k: v for k, v in GOOD_MANIFEST.items() if k != "steps"}, "manifest.json's 'steps' must be"),
    "not-an-object": ([GOOD_MANIFEST], "its manifest.json is not a JSON object but list"),
    "not-json": (b"{part: memory", "its manifest.json is not valid JSON"),
    # issue 44, group 10: what replaced a committed benchmark's results or gave a traceback
    "not-a-kit-part": ({**GOOD_MANIFEST, "part": "demo", "model": "smollm2-135m", "device": "cpu", "smoke": False,
                        "device_slug": "cpu"}, "manifest.json's 'part' must be one of the GPU kit's"),
    "gpu-run-on-cpu": ({**GOOD_MANIFEST, "device": "cpu", "device_slug": "cpu"},
                       "a part that is not a smoke run must have run on cuda"),
    "deep-nesting": (b'{"part": ' + b"[" * 100000 + b"]" * 100000 + b"}", "its manifest.json is not valid JSON"),
    "huge-int": (b'{"part": "memory", "seconds": ' + b"9" * 5000 + b"}", "its manifest.json is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_collect_refuses_a_manifest_it_cannot_name_a_folder_from_in_one_line_touching_nothing(
        case, lab, tmp_path, capsys):
    manifest, message = BAD_MANIFESTS[case]
    if isinstance(manifest, dict) and manifest.get("part") == "ABSOLUTE":
        manifest = {**manifest, "part": str(lab[2].parent / "victim")}  # results/<absolute> is that path
    archive = part_archive(tmp_path / "part.tar.gz", manifest)
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(lab[0]), "--readme", str(lab[1]))
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {archive}: {message}"), err
    assert_nothing_touched(lab)


BAD_RESULTS = {  # a results file the GPU tables read, malformed
    "memory-not-json": ("memory/ppo/memory.json", b"{phases: [", "JSONDecodeError"),
    "memory-wrong-shape": ("memory/ppo/memory.json", b'{"phases": [{"cuda": 3}]}', "Error"),
    "estimate-missing-key": ("memory/ppo/vs_estimate.json", b'{"phases": [{"phase": "update"}]}', "KeyError"),
    "decode-deep": ("memory/decode/decode.json", b'{"rows": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                    "RecursionError"),
}


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
def test_collect_refuses_a_malformed_results_file_before_writing_anything(case, lab, tmp_path, capsys):
    name, payload, error = BAD_RESULTS[case]
    archive = part_archive(tmp_path / "part.tar.gz", GOOD_MANIFEST, [(name, payload, {})])
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(lab[0]), "--readme", str(lab[1]))
    assert code == 1 and len(err) == 1 and err[0].startswith(
        f"error: {archive}: refused: a results file the GPU tables read is malformed ("), err
    assert error in err[0]
    assert_nothing_touched(lab)


def test_collect_refuses_an_archive_that_unpacks_past_its_limit(lab, tmp_path, capsys, monkeypatch):
    import benchmarks.gpu.collect as collect

    monkeypatch.setattr(collect, "MAX_UNPACKED", 1000)
    archive = part_archive(tmp_path / "part.tar.gz", GOOD_MANIFEST, [("memory/big.bin", b"\0" * 5000, {})])
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(lab[0]), "--readme", str(lab[1]))
    assert code == 1 and len(err) == 1 and "refused: it unpacks to" in err[0] and "past the 1,000" in err[0], err
    assert_nothing_touched(lab)


def test_collect_refuses_an_archive_of_too_many_members_before_unpacking_any(lab, tmp_path, capsys):
    """A tar of many empty files: refused in one line once the count passes the cap, before unpacking any."""
    from benchmarks.gpu.collect import MAX_MEMBERS

    archive = part_archive(tmp_path / "part.tar.gz", GOOD_MANIFEST,
                           [(f"memory/many/{i}.json", b"", {}) for i in range(MAX_MEMBERS)])
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(lab[0]), "--readme", str(lab[1]))
    assert code == 1 and err == [f"error: {archive}: refused: it holds more than {MAX_MEMBERS:,} members, past "
                                 "what a part's results take"], err
    assert_nothing_touched(lab)


def test_collect_says_in_one_line_that_a_file_is_not_an_archive(lab, tmp_path, capsys):
    archive = tmp_path / "part.tar.gz"
    archive.write_text("not a tar\n")
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(lab[0]), "--readme", str(lab[1]))
    assert code == 1 and err == [f"error: {archive}: not a tar archive (plain, or compressed with gzip, bzip2 or "
                                 "xz)"], err
    assert_nothing_touched(lab)


def test_collect_into_a_results_dir_that_is_a_file_is_one_line_touching_nothing(lab, tmp_path, capsys):
    results, readme, _ = lab
    archive = part_archive(tmp_path / "part.tar.gz", GOOD_MANIFEST)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("mine")
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(results), "--readme", str(readme))
    assert code == 2 and err == [f"error: --results_dir {results}: it is a file, not a folder; pick another place"]
    assert results.read_text() == "mine"
    assert readme.read_text() == "<!-- gpu-results:start -->\nold\n<!-- gpu-results:end -->\n"
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(results / "sub"), "--readme", str(readme))
    assert code == 2 and err == [f"error: --results_dir {results / 'sub'}: it is not usable (Not a directory); "
                                 "pick another place"]


def test_a_marker_inside_a_results_file_never_reaches_the_generated_section(lab, tmp_path):
    """A phase named like the section's end marker is escaped: the README keeps one section, readable."""
    from benchmarks.gpu.collect import END, START, main

    memory = json.dumps({"budget_bytes": 1, "phases": [{"phase": f"x {END} y | z", "cuda": {}}]}).encode()
    archive = part_archive(tmp_path / "part.tar.gz", GOOD_MANIFEST, [("memory/grpo/memory.json", memory, {})])
    results, readme, _ = lab
    main([str(archive), "--results_dir", str(results), "--readme", str(readme)])
    text = readme.read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and "x &lt;!-- gpu-results:end --&gt; y \\| z" in text
    main(["--results_dir", str(results), "--readme", str(readme)])  # a later collect still works
    assert readme.read_text() == text


ESCAPES = {
    "dot-dot-name": ("memory/../../victim-llama-2-7b-nvidia-h100/evil.txt", b"x", {}, "would land outside its folder"),
    "absolute-name": ("/ABSOLUTE/evil.txt", b"x", {}, "would land outside its folder"),
    "symlink": ("memory/link", b"", {"type": tarfile.SYMTYPE, "linkname": "../../victim-llama-2-7b-nvidia-h100"},
                "is a link or a special file"),
    "hardlink": ("memory/hard", b"", {"type": tarfile.LNKTYPE, "linkname": "memory/manifest.json"},
                 "is a link or a special file"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_collect_refuses_archive_members_that_are_links_or_could_land_outside(case, lab, tmp_path, capsys):
    name, payload, attrs, message = ESCAPES[case]
    name = name.replace("/ABSOLUTE", str(lab[2]))
    archive = part_archive(tmp_path / "part.tar.gz", GOOD_MANIFEST, [(name, payload, attrs)])
    code, err = collect_exit(capsys, str(archive), "--results_dir", str(lab[0]), "--readme", str(lab[1]))
    assert code == 1 and len(err) == 1 and err[0] == f"error: {archive}: refused: member {name!r} {message}", err
    assert_nothing_touched(lab)


def test_collect_files_a_well_formed_archive_and_replaces_an_earlier_copy(lab, tmp_path, capsys):
    from benchmarks.gpu.collect import main

    results, readme, _ = lab
    archive = part_archive(tmp_path / "memory-llama-2-7b-nvidia-h100.tar.gz", GOOD_MANIFEST)
    stale = results / "memory-llama-2-7b-nvidia-h100" / "stale.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    folders = main([str(archive), "--results_dir", str(results), "--readme", str(readme)])
    assert folders == [results / "memory-llama-2-7b-nvidia-h100"]
    assert sorted(str(p.relative_to(folders[0])) for p in folders[0].rglob("*")) == [
        "manifest.json", "ppo", "ppo/memory.json", "provenance.json"]
    info = json.loads((folders[0] / "provenance.json").read_text())
    assert info["steps"] == {"ppo": {"status": "ok", "seconds": 12.3}} and info["archive"] == archive.name
    assert info["device_slug"] == "nvidia-h100" and info["smoke"] is False


def test_the_plan_table_in_the_kit_readme_is_the_generated_one_and_the_first_call_fits_eight_minutes():
    """The README's plan is `python -m benchmarks.gpu.plan`'s output (measured seconds from the manifests under
    benchmarks/results/, predictions from the estimator's shapes), and the predicted first call fits 8 minutes."""
    from benchmarks.gpu.parts import BUDGET_S
    from benchmarks.gpu.plan import CALL_LIMIT_S, PACK_S, WHEELS_S, plan_table, predicted

    assert plan_table() in (ROOT / "benchmarks" / "gpu" / "README.md").read_text()
    first = predicted("first")
    assert list(first) == FIRST_STEPS
    assert BUDGET_S["first"] + WHEELS_S + PACK_S <= CALL_LIMIT_S
    # the PPO memory figures come before the TRL comparison, and fit the budget by the plan
    assert sum(first[s] for s in FIRST_STEPS[: FIRST_STEPS.index("vs-estimate") + 1]) < BUDGET_S["first"]


def test_the_grpo_vs_trl_part_runs_trl_s_recipe_on_both_sides_then_the_seed_ppo_under_12_gb(tmp_path):
    """The part after speed: TRL's QLoRA GRPO recipe on ours (as the stage plans it, and decoding from the
    4-bit weights) and on TRL's GRPOTrainer under the 24 GB cap, then the seed PPO recipe's two steps under a
    12 GB cap (its budget check at 12 too) and its memory against the estimate; collect tabulates it, each of ours
    over TRL's."""
    from benchmarks.gpu.collect import grpo_trl_rows
    from benchmarks.gpu.parts import BUDGET_S, PARTS, PartArguments, steps_for

    assert PARTS.index("grpo_vs_trl") == PARTS.index("speed") + 1 and BUDGET_S["grpo_vs_trl"] <= 480
    steps = steps_for(PartArguments(part="grpo_vs_trl", out=str(tmp_path)), tmp_path)
    assert [s.name for s in steps] == ["grpo_vs_trl", "sft+reward", "ppo-12gb", "vs-estimate-12gb"]
    assert steps[3].argv[1:] == ["-m", "benchmarks.gpu.vs_estimate", str(tmp_path / "ppo")]
    bench = steps[0].argv
    assert bench[1:3] == ["-m", "benchmarks.grpo_vs_trl"]
    assert bench[bench.index("--model_name_or_path") + 1] == "qwen2.5-7b" and "--simulate_gpu_gib" in bench
    assert bench[bench.index("--sides") + 1] == "ours,ours_4bit,trl"
    ppo = steps[2].argv

    def last(flag: str) -> str:  # argparse keeps a flag's last value
        return ppo[len(ppo) - 1 - ppo[::-1].index(flag) + 1]

    assert last("--simulate_gpu_gib") == "12" and last("--memory_budget_gib") == "12" and "trainer/ppo.py" in ppo
    smoke = ROOT / "tests" / "fixtures" / "kit" / "grpo_vs_trl-tiny-llama-smoke"
    rows = grpo_trl_rows(smoke)
    sides = json.loads((smoke / "grpo_vs_trl" / "grpo_vs_trl.json").read_text())["sides"]
    ours = [side for side in ("ours", "ours_4bit") if side in sides]
    assert [row.split(" | ")[1] for row in rows] == [*sides, *(f"{side} / TRL" for side in ours)]
    assert all(row.split(" | ")[2] == "ok" for row in rows[:len(sides)])


def test_collect_keeps_an_earlier_run_s_results_of_a_step_the_new_run_did_not_finish(lab, tmp_path):
    """A part run whose budget cut a step: the step's finished results from the earlier collected run stay
    (latest finished run of each benchmark), named under provenance.json's `kept` with their revision; a step
    the new run finished replaces the earlier one; a chain of cut runs keeps them still."""
    from benchmarks.gpu.collect import main

    results, readme, _ = lab

    def archive(name, statuses, revision):
        steps = [{"name": step, "status": status, "seconds": 1.0,
                  "argv": ["python", "-m", "x", "--out_dir", f".gpu-work/memory/{step}"]}
                 for step, status in statuses.items()]
        extra = [(f"memory/{step}/result.json", json.dumps({"rev": revision}).encode(), {})
                 for step, status in statuses.items() if status == "ok"]
        extra += [(f"memory/logs/{step}.log", f"{step} {status} {revision}".encode(), {})
                  for step, status in statuses.items()]
        return part_archive(tmp_path / name, {**GOOD_MANIFEST, "git_revision": revision, "date": revision,
                                               "steps": steps}, extra)

    def collect(path):
        return main([str(path), "--results_dir", str(results), "--readme", str(readme)])[0]

    collect(archive("a.tar.gz", {"decode": "ok", "grpo": "ok"}, "rev1"))
    folder = collect(archive("b.tar.gz", {"decode": "cut", "grpo": "ok"}, "rev2"))
    assert json.loads((folder / "decode" / "result.json").read_text()) == {"rev": "rev1"}
    assert json.loads((folder / "grpo" / "result.json").read_text()) == {"rev": "rev2"}
    info = json.loads((folder / "provenance.json").read_text())
    assert info["kept"] == {"decode": {"folder": "decode", "git_revision": "rev1", "date": "rev1"}}
    assert info["steps"]["decode"]["status"] == "cut"
    assert (folder / "logs" / "decode.log").read_text() == "decode cut rev2"
    assert (folder / "logs" / "decode.kept.log").read_text() == "decode ok rev1"
    folder = collect(archive("c.tar.gz", {"decode": "failed", "grpo": "cut"}, "rev3"))
    info = json.loads((folder / "provenance.json").read_text())
    assert {k: v["git_revision"] for k, v in info["kept"].items()} == {"decode": "rev1", "grpo": "rev2"}
    folder = collect(archive("d.tar.gz", {"decode": "ok", "grpo": "ok"}, "rev4"))
    assert "kept" not in json.loads((folder / "provenance.json").read_text())


def test_vs_estimate_estimates_with_the_cuda_context_the_run_measured_at_its_start(tmp_path):
    """On CUDA the comparison's estimate is the run's own: the context the run measured at its start (what its
    planner had, not the larger one its phases hold once CUDA has loaded their kernels), plus the kernels the
    estimator assumes; a record without a start figure gets the assumed one, and the report says which."""
    from benchmarks.gpu.vs_estimate import compare, predicted_for
    from profiling import components as C

    run = tmp_path / "ppo"
    shutil.copytree(ROOT / "tests" / "fixtures" / "kit" / "first-tiny-llama-smoke" / "ppo", run)
    memory = json.loads((run / "memory.json").read_text())
    memory["device"] = "cuda:0"
    for i, phase in enumerate(memory["phases"]):
        phase["components"][C.CUDA_CONTEXT] = int((1.4 + 0.01 * i) * C.GIB)  # held in the phases: not the estimate's
    memory["cuda_context_at_start"] = int(0.66 * C.GIB)
    (run / "memory.json").write_text(json.dumps(memory))
    _, predicted, said = predicted_for(run)
    assert [p["components"][C.CUDA_CONTEXT] for p in predicted["phases"]] == pytest.approx(
        [(0.66 + 0.9) * C.GIB] * len(predicted["phases"]), abs=2)
    assert said.startswith("0.660 GiB at the start (the run measured it) + 0.9 GiB")
    assert compare(run)["estimate_cuda_context"] == said
    assert f"- the estimate's CUDA context: {said}" in (run / "vs_estimate.md").read_text()
    del memory["cuda_context_at_start"]  # a record from before runs kept their start figure
    (run / "memory.json").write_text(json.dumps(memory))
    _, predicted, said = predicted_for(run)
    assert [p["components"][C.CUDA_CONTEXT] for p in predicted["phases"]] == pytest.approx(
        [(0.5 + 0.9) * C.GIB] * len(predicted["phases"]), abs=2)
    assert "assumed: the record has no start figure" in said


def test_the_kit_carries_the_project_s_pins_and_a_bitsandbytes_wheel_slimmed_to_one_cuda_major(tmp_path):
    """prepare.sh's wheels: pyproject.toml's `==` pins of transformers, tokenizers and peft (what this venv
    runs), and a wheel rewritten without the other CUDA majors' and ROCm's libraries and their RECORD lines,
    its Python, CPU library and RECORD otherwise as they were; a slim wheel is left alone."""
    import zipfile
    from importlib.metadata import version

    from benchmarks.gpu.wheels import pins, slim

    assert pins() == {name: version(name) for name in ("transformers", "tokenizers", "peft")}
    names = ["pkg/__init__.py", "pkg/libpkg_cpu.so", "pkg/libpkg_cuda130.so", "pkg/libpkg_cuda132.so",
             "pkg/libpkg_cuda128.so", "pkg/libpkg_cuda118.so", "pkg/libpkg_rocm72.so"]
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name in names:
            out.writestr(name, name * 1000)
        out.writestr("pkg-1.0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(n) * 1000}\n" for n in names)
                     + "pkg-1.0.dist-info/RECORD,,\n")
    assert slim(wheel, "13") > 0
    kept = names[:4]
    with zipfile.ZipFile(wheel) as got:
        assert sorted(got.namelist()) == sorted([*kept, "pkg-1.0.dist-info/RECORD"])
        assert got.read("pkg/libpkg_cuda130.so") == b"pkg/libpkg_cuda130.so" * 1000
        record = got.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in record] == [*kept, "pkg-1.0.dist-info/RECORD"]
    assert slim(wheel, "13") == 0
