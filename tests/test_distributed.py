"""Scale-out on CPU, launched the way the README says.

Two gloo processes train exactly like one process with twice the accumulation, each rank on its
own rows; DeepSpeed ZeRO-2 with CPU optimizer offload steps, skips a NaN step as DDP does, and
resumes from its engine checkpoint; the launch modes a run cannot use are refused in one line. A launch runs
several stages one after another in the same processes, as the pipeline does.

The DeepSpeed tests need DeepSpeed's cpu_adam op, which `make test` compiles first (tests/build_ops.py), cached
under $TORCH_EXTENSIONS_DIR (default: the project cache), so CI pays it once.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
TINY_PPO = ROOT / "tests" / "configs" / "tiny_ppo.yaml"
CONFIGS = ROOT / "accelerate_configs"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# A curve that moves: a 10x larger learning rate than tiny_sft's, and no dropout (its masks would
# differ between one process and two).
CURVE = ("--max_steps", "4", "--save_every", "0", "--eval_every", "2", "--lora_dropout", "0",
         "--learning_rate", "0.02")
CURVE_KEYS = ("train/loss", "train/grad_norm", "train/lr", "train/skipped_steps", "eval/loss", "eval/accuracy",
              "eval/margin")

# SFT with two probes: a NaN loss on one chosen micro-batch (RLHF_TEST_POISON="RANK:CALL", 1-based call on that
# rank), and rank 0's gradient of the first optimizer step (after DDP's all-reduce) saved to OUTPUT_DIR/gradient.pt.
PROBED_SFT = """
import os, sys
sys.path.insert(0, {root!r})
from pathlib import Path

import torch

from trainer import sft
from trainer.engine.harness import Engine

real, calls = sft.completion_nll, [0]
rank, call = (int(x) for x in os.environ["RLHF_TEST_POISON"].split(":"))

def poisoned(model, batch, adapter):
    loss_sum, count = real(model, batch, adapter)
    if torch.is_grad_enabled():  # training micro-batches only, not evaluation
        calls[0] += 1
        if int(os.environ.get("RANK", "0")) == rank and calls[0] == call:
            loss_sum = loss_sum * float("nan")
    return loss_sum, count

real_step, out = Engine.optimizer_step, Path(sys.argv[sys.argv.index("--output_dir") + 1])

def saving(self, finite=True):
    if int(os.environ.get("RANK", "0")) == 0 and not (out / "gradient.pt").exists():
        torch.save({{n.removeprefix("module."): p.grad.detach().clone() for n, p in self.model.named_parameters()
                    if p.grad is not None}}, out / "gradient.pt")
    return real_step(self, finite)

sft.completion_nll, Engine.optimizer_step = poisoned, saving
try:
    sft.main(sys.argv[1:])
finally:  # the one-process run is in the test's process
    sft.completion_nll, Engine.optimizer_step = real, real_step
"""
# Step 2 (micro-batch calls 5-8 of one process with accumulation 4) takes the NaN on the one process's 6th call,
# and on rank 1's 3rd call (its first of step 2) of two processes with accumulation 2.
POISON_ONE_PROCESS, POISON_TWO_PROCESSES = "0:6", "1:3"
NAN_STEP = ((2, "train/loss"), (2, "train/grad_norm"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_args(output_dir: Path, *extra: str, train_config: Path = TINY_SFT) -> list[str]:
    return ["--config", str(train_config), "--output_dir", str(output_dir), *extra]


def launch(config: str, processes: int, script: Path, *args: str, expect_ok: bool = True,
           poison: str | None = None) -> str:
    """`accelerate launch --config_file accelerate_configs/CONFIG --num_processes N script ARGS`, one thread a
    process: the log of every process (stdout, then stderr)."""
    from trainer.config import cache_dir

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_dir() / "torch_extensions")}
    if poison is not None:
        env["RLHF_TEST_POISON"] = poison
    cmd = [ACCELERATE, "launch", "--config_file", str(CONFIGS / config), "--num_processes", str(processes),
           "--main_process_port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, out[-4000:]
    else:
        assert proc.returncode != 0, out[-4000:]
    return out


# The runs of one launch, in turn in the same processes (the process group stays up between them, as between the
# pipeline's stages): each {"script", "args", "trace"} through its `__main__` with fresh Accelerate singletons, the
# rows each rank trains on recorded into "trace" where given (benchmarks/row_trace.py); a {"copy": [FROM, TO]}
# copies a folder on rank 0 while the other ranks wait.
RUNS = """
import json, os, runpy, shutil, sys
sys.path.insert(0, {root!r})
from contextlib import nullcontext

import torch.distributed as dist

# DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op (shm_comm) when its process group starts, for
# its inference all-reduce alone, which training never calls: not here. Its cpu_adam op is loaded as
# tests/build_ops.py built it.
if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # deepspeed.comm.torch is torch
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    importlib.import_module("build_ops").without_debug_info()

from benchmarks.row_trace import traced
from trainer.engine.launch import reset_accelerate

for run in json.loads(sys.argv[1]):
    if "copy" in run:
        if dist.get_rank() == 0:
            shutil.copytree(*run["copy"])
        dist.barrier()
        continue
    sys.argv = [run["script"], *run["args"]]
    reset_accelerate()
    with traced(run["trace"]) if run["trace"] else nullcontext():
        runpy.run_path(run["script"], run_name="__main__")
"""


def launch_runs(folder: Path, config: str, runs: list[dict], poison: str | None = None, processes: int = 2,
                expect_ok: bool = True) -> str:
    """Processes under accelerate_configs/CONFIG that run `runs` (see `RUNS`) in turn: the launch's log."""
    driver = folder / "runs.py"
    driver.write_text(RUNS.format(root=str(ROOT)))
    return launch(config, processes, driver, json.dumps(runs), poison=poison, expect_ok=expect_ok)


def stage_run(script: Path, output_dir: Path, *extra: str, trace: Path | None = None,
              train_config: Path = TINY_SFT) -> dict:
    """One entry of `launch_runs`."""
    return {"script": str(script), "args": stage_args(output_dir, *extra, train_config=train_config),
            "trace": str(trace) if trace else None}


def run_here(script: Path | str, args: list[str], trace: Path | None, env: dict[str, str]) -> None:
    """`python script ARGS` in this process (its `__main__`, as row_trace runs it; the one-process reference runs),
    on one thread as each launched process runs, with `env` set and fresh Accelerate singletons; the scripts here
    undo their patches at the end. With `trace`, the rows it trains on are recorded into that folder."""
    import runpy
    from contextlib import nullcontext

    from benchmarks.row_trace import traced
    from trainer.engine.launch import reset_accelerate

    threads, argv = torch.get_num_threads(), sys.argv
    sys.argv = [str(script), *args]
    torch.set_num_threads(1)
    reset_accelerate()
    try:
        with pytest.MonkeyPatch.context() as patch, traced(trace) if trace else nullcontext():
            for key, value in env.items():
                patch.setenv(key, value)
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        reset_accelerate()


def curve(run_dir: Path) -> dict[tuple[int, str], float]:
    """{(step, key): value} from metrics.jsonl, asserting each (step, key) was written once (rank 0 only)."""
    values: dict[tuple[int, str], float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in CURVE_KEYS:
            if key in row:
                assert (row["step"], key) not in values, f"step {row['step']} {key} logged twice"
                values[row["step"], key] = row[key]
    return values


def traced_rows(trace: Path, rank: int) -> dict[int, list[str]]:
    rows: dict[int, list[str]] = {}
    for line in (trace / f"rows-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(record["step"], []).extend(record["rows"])
    return rows


def assert_same_curve(a: dict, b: dict, rel: float = 1e-4, skip: tuple = ()) -> None:
    """Equal to float rounding. The all-reduce sums gradients in another order than one process's
    accumulation; Adam's division by sqrt(v) grows those ~1e-7 differences in small gradients (see
    assert_close_adapters), so metrics after a few updates agree to ~1e-5 relative, not to 1e-7 (CI once
    saw 1.2e-5 on the reward model's eval margin). A wrong split of rows or a wrong gradient scale moves
    them by far more: the loss moves > 1e-3 in these four steps, and grad_norm is in the curve."""
    keys = [k for k in a if k not in skip]
    assert sorted(keys) == sorted(k for k in b if k not in skip)
    for key in keys:
        assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), key


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def assert_close_adapters(a: Path, b: Path, atol: float = 1e-5) -> None:
    """Adam divides by sqrt(v): float-rounding differences in small gradients grow to ~1e-6 in weights."""
    wa, wb = adapter(a), adapter(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].numel() > 0, key
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=atol)


# ---- DDP over gloo and DeepSpeed: two processes equal one with twice the accumulation ------------

def assert_two_processes_match_one(one: Path, two: Path, rows_per_step: int, skip: tuple = (),
                                   adapter_atol: float = 1e-5) -> None:
    reference, distributed = curve(one), curve(two)
    assert sorted({s for s, k in reference if k.startswith("train/")}) == [1, 2, 3, 4]
    assert sorted({s for s, k in reference if k.startswith("eval/")}) == [0, 2, 4]
    assert reference[4, "train/loss"] != pytest.approx(reference[1, "train/loss"], rel=1e-3)  # it moved
    assert_same_curve(reference, distributed, skip=skip)
    assert_close_adapters(one / "adapter", two / "adapter", atol=adapter_atol)

    # Each optimizer step: the ranks' micro-batches are disjoint and together are the one process's.
    single, rank0, rank1 = traced_rows(one / "rows", 0), traced_rows(two / "rows", 0), traced_rows(two / "rows", 1)
    assert sorted(single) == sorted(rank0) == sorted(rank1) == [1, 2, 3, 4]
    for step in single:
        assert len(single[step]) == rows_per_step
        assert len(rank0[step]) == len(rank1[step]) == rows_per_step // 2
        assert not set(rank0[step]) & set(rank1[step])
        assert sorted(rank0[step] + rank1[step]) == sorted(single[step])
    assert not (two / "rows" / "rows-rank2.jsonl").exists()


SFT = ROOT / "trainer" / "sft.py"
REWARD = ROOT / "trainer" / "reward.py"
PPO_DDP = ("--max_steps", "2", "--save_every", "0", "--adaptive_kl", "true", "--target_kl", "0.01",
           "--kl_horizon", "40", "--init_kl_coef", "0.2")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The runs the tests below read, in two launches of two processes and one run in this process: (the folder
    that holds them, the DeepSpeed launch's log).

    One SFT run three ways, each with a NaN loss in step 2 on one rank and the gradient of step 1 saved: "one" (1
    process x accumulation 4, micro-batches in shuffled order), "ddp" and "zero2" (2 processes x 2, grouped by length,
    under DDP and under DeepSpeed ZeRO-2 offload). After "ddp" in its launch, "reward" (the reward model, 2 x 2) and
    "ppo" (two PPO steps with the adaptive KL controller, `PPO_PROBES`); after "zero2" in its launch, "resumed": SFT
    resumed from a copy of zero2's checkpoint 2."""
    root = tmp_path_factory.mktemp("runs")
    script, ppo = root / "probed_sft.py", root / "ppo_probes.py"
    script.write_text(PROBED_SFT.format(root=str(ROOT)))
    ppo.write_text(PPO_PROBES)
    args = (*CURVE, "--save_every", "1", "--keep_checkpoints", "5")
    run_here(script, stage_args(root / "one", *args, "--gradient_accumulation_steps", "4",
                                "--group_by_length", "false"), root / "one" / "rows",
             {"RLHF_TEST_POISON": POISON_ONE_PROCESS})
    launch_runs(root, "cpu_2proc.yaml", [
        stage_run(script, root / "ddp", *args, "--gradient_accumulation_steps", "2", "--group_by_length", "true",
                  trace=root / "ddp" / "rows"),
        stage_run(REWARD, root / "reward", *CURVE, "--gradient_accumulation_steps", "2",
                  trace=root / "reward" / "rows"),
        stage_run(ppo, root / "ppo", *PPO_DDP, train_config=TINY_PPO)], poison=POISON_TWO_PROCESSES)
    zero2 = (*args, "--gradient_accumulation_steps", "2", "--optimizer", "paged_adamw_8bit")
    ckpt = "checkpoint-0000002"  # the skipped step
    log = launch_runs(root, "deepspeed_zero2_offload.yaml", [
        stage_run(script, root / "zero2", *zero2, trace=root / "zero2" / "rows"),
        {"copy": [str(root / "zero2" / ckpt), str(root / "resumed" / ckpt)]},
        stage_run(SFT, root / "resumed", *zero2)], poison=POISON_TWO_PROCESSES)
    return root, log


@pytest.mark.slow
def test_two_gloo_processes_train_sft_like_one_process_with_twice_the_accumulation(launches):
    root, _ = launches
    assert_two_processes_match_one(root / "one", root / "ddp", rows_per_step=4 * 4, skip=NAN_STEP)


@pytest.mark.slow
def test_two_gloo_processes_train_the_reward_model_like_one_process_with_twice_the_accumulation(launches, tmp_path):
    root, _ = launches
    one = tmp_path / "one"
    run_here(REWARD, stage_args(one, *CURVE, "--gradient_accumulation_steps", "4"), one / "rows", {})
    assert_two_processes_match_one(one, root / "reward", rows_per_step=4 * 4)  # one row per pair (the prompt once)


@pytest.mark.slow
def test_an_sft_step_has_the_same_gradient_on_two_processes_grouped_as_on_one_ungrouped(launches):
    """Every completion token of a step weighs the same, whichever rank and micro-batch holds it: one process
    accumulating 4 micro-batches in shuffled order, and two accumulating 2 each grouped by length, take the
    same 16 real hh-rlhf rows to the same gradient, to float rounding."""
    root, _ = launches
    one, two = root / "one", root / "ddp"
    single, rank0, rank1 = traced_rows(one / "rows", 0), traced_rows(two / "rows", 0), traced_rows(two / "rows", 1)
    assert sorted(rank0[1] + rank1[1]) == sorted(single[1]) and len(single[1]) == 16  # the same rows
    reference, distributed = torch.load(one / "gradient.pt"), torch.load(two / "gradient.pt")
    assert reference.keys() == distributed.keys() and len(reference) > 0
    difference = torch.cat([(distributed[k] - reference[k]).flatten() for k in reference]).norm()
    size = torch.cat([reference[k].flatten() for k in reference]).norm()
    print(f"relative gradient difference, 2 processes grouped vs 1 process not: {float(difference / size):.2e}")
    assert size > 0 and difference / size < 1e-6, float(difference / size)


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_skips_the_whole_step_on_every_rank_in_every_launch_mode(launches):
    root, _ = launches
    for run in ("one", "ddp", "zero2"):
        metrics = curve(root / run)
        assert [metrics[s, "train/skipped_steps"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0], run
        assert metrics[3, "train/lr"] == metrics[2, "train/lr"] > metrics[1, "train/lr"], run  # warmup waits
        ckpt = lambda step: adapter(root / run / f"checkpoint-000000{step}" / "adapters" / "policy")  # noqa: E731
        assert all(torch.equal(ckpt(1)[k], ckpt(2)[k]) for k in ckpt(1)), run  # nothing moved in step 2
        assert not all(torch.equal(ckpt(2)[k], ckpt(3)[k]) for k in ckpt(2)), run  # training went on
    assert curve(root / "zero2")[2, "train/grad_norm"] == float("inf")  # DeepSpeed's overflow check skipped it


@pytest.mark.slow
def test_deepspeed_zero2_offload_initialises_on_cpu_and_takes_the_same_steps_as_ddp(launches):
    root, log = launches
    assert "DeepSpeed ZeRO-2 with CPU optimizer offload: optimizer DeepSpeedCPUAdam, 2 micro-batches a step, " \
           "clipping at 1.0, 2 ranks" in log
    warning = ("optimizer paged_adamw_8bit -> DeepSpeed AdamW on the CPU (optimizer offload): the DeepSpeed config "
               "offloads the optimizer to CPU")
    assert log.count(warning) == 2  # one line a run (zero2, resumed), from rank 0 only
    # DeepSpeedCPUAdam's fp32 AdamW kernel rounds differently from torch.optim.AdamW (measured: 8e-6 at most).
    assert_two_processes_match_one(root / "one", root / "zero2", rows_per_step=4 * 4, skip=NAN_STEP, adapter_atol=5e-5)


@pytest.mark.slow
def test_deepspeed_checkpoint_holds_engine_shards_without_the_frozen_base_and_resumes(launches):
    root, log = launches
    ckpt = root / "zero2" / "checkpoint-0000002"
    files = sorted(p.name for p in (ckpt / "deepspeed").iterdir())
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert not (ckpt / "optimizer.pt").exists() and (ckpt / "scheduler.json").is_file()
    assert {p.name for p in ckpt.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
    module = torch.load(ckpt / "deepspeed" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module and all(".lora_" in key for key in module)  # exclude_frozen_parameters: no base weights
    assert not list(root.glob("zero2/*.tmp"))

    # A copy of checkpoint 2 (the skipped step) resumed to step 4: the same steps 3-4 as the straight run.
    resumed = root / "resumed"
    assert f"resumed from {resumed / ckpt.name} (step 2)" in log
    straight, again = curve(root / "zero2"), curve(resumed)
    # DeepSpeedCPUAdam recomputes beta^t with pow() after a load instead of multiplying it up step by
    # step, so the resumed run matches to float rounding, not bit for bit.
    assert_same_curve({k: v for k, v in straight.items() if k[0] > 2}, again)
    assert_close_adapters(root / "zero2" / "adapter", resumed / "adapter")


# ---- refused up front --------------------------------------------------------------------------------

@pytest.mark.slow
def test_ppo_under_zero3_is_refused_at_start_in_one_line(tmp_path):
    out = tmp_path / "ppo"
    # One process: the refusal comes before any collective, and the launcher reports it as for more.
    run = stage_run(ROOT / "trainer" / "ppo.py", out, train_config=TINY_PPO)
    log = launch_runs(tmp_path, "deepspeed_zero3.yaml", [run], processes=1, expect_ok=False)
    line = ("error: ppo under DeepSpeed ZeRO-3 is not supported: it generates with and switches its adapters on one "
            "base whose weights DeepSpeed ZeRO-3 partitions across ranks (untested, and every switch or decoded token "
            "would gather the whole base); use accelerate_configs/multi_gpu.yaml or "
            "accelerate_configs/deepspeed_zero2_offload.yaml")
    assert [text for text in log.splitlines() if text.startswith("error: ")] == [line]
    assert "[rank0]: Traceback" not in log  # the launcher reports the exit; the trainer printed no stack trace
    assert any(text.strip() == f"traceback : {line}" for text in log.splitlines())  # the launcher's root cause
    assert not list(out.glob("checkpoint-*"))


def fake_accelerator(kind: str, ds_config: dict | None = None):
    from accelerate.utils import DistributedType

    types = {"ddp": DistributedType.MULTI_GPU, "fsdp": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED}
    plugin = SimpleNamespace(deepspeed_config=ds_config or {})
    return SimpleNamespace(distributed_type=types[kind], state=SimpleNamespace(deepspeed_plugin=plugin),
                           is_main_process=True, device=torch.device("cpu"))


ZERO2_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
ZERO3 = {"zero_optimization": {"stage": 3}}


@pytest.mark.parametrize("stage, kind, config", [("dpo", "fsdp", None), ("ppo", "fsdp", None),
                                                 ("dpo", "deepspeed", ZERO3), ("ppo", "deepspeed", ZERO3)])
def test_adapter_switching_stages_are_refused_where_the_base_is_sharded(stage, kind, config):
    from trainer.engine.launch import LaunchError, check_launch

    mode = "FSDP" if kind == "fsdp" else "DeepSpeed ZeRO-3"
    with pytest.raises(LaunchError, match=f"^{stage} under {mode} is not supported: it .* use "
                                          "accelerate_configs/multi_gpu.yaml or accelerate_configs/"
                                          "deepspeed_zero2_offload.yaml$"):
        check_launch(fake_accelerator(kind, config), stage)


@pytest.mark.parametrize("stage, kind, config", [("sft", "deepspeed", ZERO3), ("reward", "fsdp", None),
                                                 ("ppo", "deepspeed", ZERO2_OFFLOAD), ("ppo", "ddp", None)])
def test_stages_that_can_run_pass_the_launch_check(stage, kind, config):
    from trainer.engine.launch import check_launch

    check_launch(fake_accelerator(kind, config), stage)


def test_fsdp_launch_on_a_cpu_machine_is_refused_with_what_to_use_instead(monkeypatch):
    from trainer.engine.launch import LaunchError, accelerator_kwargs

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(LaunchError, match=r"^FSDP \(accelerate_configs/fsdp_qlora.yaml\) needs CUDA GPUs; on CPU use "
                                          r"accelerate_configs/cpu_2proc.yaml"):
        accelerator_kwargs()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert accelerator_kwargs() == {"cpu": False}  # DeepSpeed brings its own CPU backend
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert accelerator_kwargs() == {"cpu": True}


@pytest.mark.parametrize("asked", ["paged_adamw_8bit", "adamw_8bit", "adamw_torch", "auto"])
def test_deepspeed_optimizer_offload_replaces_a_client_optimizer_and_says_so_for_8bit(asked, caplog):
    from accelerate.utils import DummyOptim

    from foundation.settings import TrainArguments
    from trainer.engine.optim import build_loop_optimizer

    config = json.loads(json.dumps(ZERO2_OFFLOAD))
    params = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))]
    args = TrainArguments(optimizer=asked, learning_rate=1e-3, weight_decay=0.1)
    with caplog.at_level("INFO", logger="trainer.engine.optim"):
        optimizer = build_loop_optimizer(params, args, fake_accelerator("deepspeed", config))
    assert isinstance(optimizer, DummyOptim) and optimizer.lr == 1e-3 and optimizer.weight_decay == 0.1
    assert [g["weight_decay"] for g in optimizer.params] == [0.1, 0.0]  # no decay on biases, as elsewhere
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["lr"] == "auto"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if asked.endswith("8bit"):
        assert warnings == [
            f"optimizer {asked} -> DeepSpeed AdamW on the CPU (optimizer offload): the DeepSpeed config offloads the "
            "optimizer to CPU, and its offloaded step runs only DeepSpeed's own optimizer; for "
            f"{asked} launch without DeepSpeed optimizer offload (accelerate_configs/single_gpu.yaml or "
            "multi_gpu.yaml)"]
    else:
        assert warnings == []


def test_4bit_base_is_stored_in_the_compute_dtype_only_where_zero3_or_fsdp_shard_it():
    import copy

    from foundation.settings import ModelArguments
    from trainer.engine.launch import quant_storage_for
    from trainer.model.loading import load_base_model, quantize_linears_

    bf16 = torch.bfloat16
    assert quant_storage_for(bf16, fake_accelerator("deepspeed", ZERO3)) == bf16
    assert quant_storage_for(bf16, fake_accelerator("fsdp")) == bf16
    assert quant_storage_for(bf16, fake_accelerator("deepspeed", ZERO2_OFFLOAD)) == torch.uint8
    assert quant_storage_for(bf16, fake_accelerator("ddp")) == torch.uint8

    # The storage dtype only relabels the packed bytes: same bytes, same outputs.
    base = load_base_model(ModelArguments(model_name_or_path="tiny-llama", quantization="none",
                                          gradient_checkpointing=False), vocab_size=512, device=torch.device("cpu"))
    packed, relabelled = copy.deepcopy(base), copy.deepcopy(base)
    quantize_linears_(packed, bf16, torch.device("cpu"))
    quantize_linears_(relabelled, bf16, torch.device("cpu"), quant_storage=bf16)
    a, b = packed.model.layers[0].mlp.up_proj.weight, relabelled.model.layers[0].mlp.up_proj.weight
    assert (a.dtype, b.dtype) == (torch.uint8, bf16)
    assert torch.equal(a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten())
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(packed(input_ids=ids).logits, relabelled(input_ids=ids).logits)


def test_checkpoint_from_another_launch_mode_is_refused_with_what_to_do(tmp_path):
    from trainer.engine.checkpoint import CheckpointError, select_checkpoint

    ckpt = tmp_path / "checkpoint-0000002"
    (ckpt / "deepspeed").mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match="was written under DeepSpeed .* resume it with the DeepSpeed launch "
                                              "config, or start fresh with --resume no"):
        select_checkpoint(tmp_path, str(ckpt), deepspeed=False)
    shutil.rmtree(ckpt / "deepspeed")
    with pytest.raises(CheckpointError, match="was not written under DeepSpeed"):
        select_checkpoint(tmp_path, str(ckpt), deepspeed=True)


def test_every_launch_config_parses_and_points_at_its_deepspeed_file():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {"single_gpu": ("NO", 1), "multi_gpu": ("MULTI_GPU", 2), "cpu": ("NO", 1),
                "cpu_2proc": ("MULTI_GPU", 2), "deepspeed_zero2_offload": ("DEEPSPEED", 1),
                "deepspeed_zero3": ("DEEPSPEED", 2), "fsdp_qlora": ("FSDP", 2)}
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(expected)
    for name, (kind, processes) in expected.items():
        config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
        assert (str(config.distributed_type).split(".")[-1], config.num_processes) == (kind, processes), name
        if kind == "DEEPSPEED":
            ds = json.loads((ROOT / config.deepspeed_config["deepspeed_config_file"]).read_text())
            for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                        "gradient_clipping"):
                assert ds[key] == "auto", (name, key)
            assert ds["optimizer"]["params"]["lr"] == "auto"
            assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    zero3 = json.loads((ROOT / "ds_configs" / "zero3_offload.json").read_text())["zero_optimization"]
    assert (zero3["stage"], zero3["offload_param"]["device"]) == (3, "cpu")


# PPO where every rank saves its trainable weights before and after training, and appends each (KL, beta) of the
# adaptive KL controller, each into its own file beside the script (in `launches`).
PPO_PROBES = """
import json, os, sys
from pathlib import Path
import torch
import trainer.rl.kl_control as kl_control
import trainer.ppo as ppo
real_update, real_train = kl_control.AdaptiveKLController.update, ppo.train
here, rank = Path(__file__).parent, os.environ.get("RANK", "0")

def update(self, current_kl, n_steps):
    real_update(self, current_kl, n_steps)
    with open(here / f"beta_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"kl": float(current_kl), "beta": self.value}) + "\\n")

def train(ctx, model, prompts, held_out, scorer):
    weights = lambda: [p.detach().cpu().clone() for p in model.trainable_parameters()]
    before = weights()
    state = real_train(ctx, model, prompts, held_out, scorer)
    torch.save({"before": before, "after": weights()}, here / f"weights_rank{rank}.pt")
    return state

kl_control.AdaptiveKLController.update, ppo.train = update, train
try:
    ppo.main(sys.argv[1:])
finally:
    kl_control.AdaptiveKLController.update, ppo.train = real_update, real_train
"""


@pytest.mark.slow
def test_ppo_under_ddp_keeps_both_ranks_policy_and_value_identical(launches):
    """Each rank samples its own prompts; synced gradients keep the trainable weights equal."""
    import math

    root, _ = launches
    ranks = [torch.load(root / f"weights_rank{rank}.pt") for rank in (0, 1)]
    for before, after in zip(ranks[0]["before"], ranks[0]["after"]):
        assert before.shape == after.shape
    assert any(not torch.equal(b, a) for b, a in zip(ranks[0]["before"], ranks[0]["after"])), "nothing trained"
    for w0, w1 in zip(ranks[0]["after"], ranks[1]["after"]):
        assert torch.equal(w0, w1)
    first = [json.loads(line) for line in (root / "ppo" / "metrics.jsonl").read_text().splitlines()][1]
    assert first["step"] == 1 and all(math.isfinite(v) for v in first.values())  # finite, logged once


@pytest.mark.slow
def test_adaptive_kl_coefficient_moves_alike_on_every_rank(launches):
    """The ranks sample different prompts, so their KLs differ: the controller must see the KL averaged
    over ranks, or each rank's beta drifts its own way (and only rank 0's is checkpointed)."""
    root, _ = launches
    traces = [[json.loads(line) for line in (root / f"beta_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(traces[0]) == len(traces[1]) == 2
    assert [t["kl"] for t in traces[0]] == [t["kl"] for t in traces[1]]  # the controller saw one KL
    assert [t["beta"] for t in traces[0]] == [t["beta"] for t in traces[1]]
    assert traces[0][-1]["beta"] != 0.2  # it did adapt
    logged = [json.loads(line) for line in (root / "ppo" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["objective/kl"] for r in logged if "objective/kl" in r]
    assert [t["kl"] for t in traces[0]] == pytest.approx(kls, rel=1e-9)  # the logged (rank-averaged) KL


@pytest.mark.parametrize("kind, config", [("deepspeed", ZERO3), ("fsdp", None)])
def test_compiled_layers_are_refused_where_the_base_is_sharded(kind, config):
    from foundation.settings import ModelArguments
    from trainer.engine.launch import Launch, LaunchError
    from trainer.engine.settle import check_combinations

    with pytest.raises(LaunchError, match="^--compile_layers is not supported under .*drop --compile_layers$"):
        check_combinations(ModelArguments(compile_layers=True), None, Launch.of(fake_accelerator(kind, config)))
    check_combinations(ModelArguments(compile_layers=True), None, Launch.of(fake_accelerator("deepspeed", ZERO2_OFFLOAD)))


def test_decode_auto_is_compiled_on_cuda_and_eager_where_a_captured_step_cannot_run(caplog):
    """--decode auto: compiled on CUDA; eager on the CPU, with the embedding in host memory, under ZeRO-3 /
    FSDP; a path given is kept. The run says what auto chose, in one line."""
    import logging

    from foundation.settings import ModelArguments
    from trainer.engine.launch import Launch
    from trainer.engine.settle import check_combinations, decode_path

    def on(kind, config=None, device="cuda"):
        accelerator = fake_accelerator(kind, config)
        accelerator.device = torch.device(device)
        return accelerator

    def path(decode="auto", offload_embeddings=False, accelerator=None):
        accelerator = accelerator or on("ddp")
        check_combinations(ModelArguments(offload_embeddings=offload_embeddings), SimpleNamespace(decode=decode),
                           Launch.of(accelerator))
        return decode_path(decode, offload_embeddings, accelerator.device, Launch.of(accelerator))

    with caplog.at_level(logging.INFO, logger="trainer.engine.settle"):
        assert path() == "compiled"
    assert "decode auto: compiled (CUDA" in caplog.text
    assert path(accelerator=on("ddp", device="cpu")) == "eager"
    assert path(offload_embeddings=True) == "eager"
    assert path(accelerator=on("deepspeed", ZERO3)) == path(accelerator=on("fsdp")) == "eager"
    assert path(accelerator=on("deepspeed", ZERO2_OFFLOAD)) == "compiled"
    assert path("eager") == "eager" and path("compiled", accelerator=on("ddp", device="cpu")) == "compiled"


def test_on_cuda_the_allocator_grows_segments_in_place_unless_the_user_chose(monkeypatch):
    from trainer.engine.launch import ALLOC_CONF, EXPANDABLE_SEGMENTS, set_allocator_defaults

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    env = {}
    assert set_allocator_defaults(env) == EXPANDABLE_SEGMENTS and env == {ALLOC_CONF: EXPANDABLE_SEGMENTS}
    chosen = {ALLOC_CONF: "max_split_size_mb:128"}
    assert set_allocator_defaults(chosen) is None and chosen == {ALLOC_CONF: "max_split_size_mb:128"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = {}
    assert set_allocator_defaults(cpu) is None and cpu == {}
