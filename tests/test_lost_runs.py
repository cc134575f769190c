"""No lost runs: one run per output folder, a full disk or a kill during a save costs nothing saved before,
weights that can no longer train are never saved, and sampling that cannot teach is refused or warned about."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import in_process_command, killed_run

from foundation.cli import run
from trainer.engine.checkpoint import complete_checkpoints, verify_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LOCK_FILE = "run.lock"  # trainer.engine.run_lock.LOCK_FILE

# The lock's protocol, spelled out: flock on the open run.lock, which names the holder's host and pid.
HOLD_LOCK = """
import fcntl, json, os, socket, sys
lock = open(sys.argv[1], "w")
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
lock.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
lock.flush()
print("locked", flush=True)
sys.stdin.read()
"""


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s run lock until its stdin closes (or it is killed)."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder / LOCK_FILE)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def sft_argv(out: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY_SFT), "--output_dir", str(out), "--eval_every", "0", *extra]


def run_sft(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "trainer" / "sft.py"), *sft_argv(out, *extra)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=ENV)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def sft_error_line(capsys, out, *flags: str) -> str:
    """Run the SFT stage in this process into `out`: it must end with exit code 1 and one error line, no
    traceback; that line."""
    import trainer.sft as sft

    with pytest.raises(SystemExit) as exit_info:
        run(sft.main, sft_argv(out, *flags))
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert exit_info.value.code == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- one run per output folder --------------------------------------------------------------------

def test_a_second_run_on_a_busy_output_dir_stops_in_one_line_naming_host_and_pid(tmp_path):
    out = tmp_path / "run"
    holder = hold_lock(out)
    try:
        proc = in_process_command("trainer.sft", sft_argv(out, "--max_steps", "1"))
    finally:
        holder.communicate("")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    host = socket.gethostname()
    assert lines[0].startswith(f"error: --output_dir {out} is in use by pid {holder.pid} on host {host}")
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]  # nothing of the second run's written


def test_a_lock_left_by_a_killed_run_on_this_host_is_taken_over_with_one_warning(tmp_path, caplog):
    from trainer.engine.run_lock import RunLock, RunLocked

    holder = hold_lock(tmp_path)
    with pytest.raises(RunLocked, match=f"in use by pid {holder.pid} on host {socket.gethostname()}"):
        RunLock.acquire(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # stale: nobody holds its flock
    with caplog.at_level(logging.WARNING, logger="trainer.engine.run_lock"):
        lock = RunLock.acquire(tmp_path)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and f"taking over the lock of pid {holder.pid} on host" in warnings[0], warnings
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_naming_another_host_is_refused_and_never_taken_over(tmp_path):
    from trainer.engine.run_lock import RunLock, RunLocked

    stale = json.dumps({"host": "other-host.example", "pid": 4242, "started": "2030-01-01 00:00:00"})
    (tmp_path / LOCK_FILE).write_text(stale)
    with pytest.raises(RunLocked, match="locked by pid 4242 on host other-host.example, started 2030-01-01 "
                                        ".*a lock of another host is never taken over"):
        RunLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == stale


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "folder", "fifo", "unreadable"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_in_one_line_and_nothing_outside_is_written(tmp_path, kind):
    """run.lock is opened without following links: a link to a file outside the folder is never truncated or
    written; a folder, a FIFO or an unopenable file is one line naming it, not a traceback or a hang."""
    from trainer.engine.run_lock import RunLock, RunLocked

    out, outside = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text("keep me")
    lock = out / LOCK_FILE
    if kind == "symlink":
        lock.symlink_to(outside)
    elif kind == "dangling symlink":
        lock.symlink_to(tmp_path / "nowhere.txt")
    elif kind == "folder":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.write_text("{}")
        lock.chmod(0)
        if os.access(lock, os.R_OK):  # root reads anything
            pytest.skip("running as root: every file is readable")
    with pytest.raises(RunLocked) as raised:
        RunLock.acquire(out)
    message = str(raised.value)
    assert "\n" not in message and str(lock) in message and "remove it" in message
    assert outside.read_text() == "keep me" and not (tmp_path / "nowhere.txt").exists()


def test_a_lock_file_that_is_not_utf8_claims_nothing_and_is_taken(tmp_path):
    from trainer.engine.run_lock import RunLock

    (tmp_path / LOCK_FILE).write_bytes(b"\xff\xfe garbage \x80")
    lock = RunLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_without_flock_a_live_holder_is_refused_and_a_dead_one_taken_over(tmp_path, monkeypatch, caplog):
    import trainer.engine.run_lock as run_lock
    from trainer.engine.run_lock import RunLock, RunLocked

    def no_flock(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": alive.pid}))
        with pytest.raises(RunLocked, match=f"in use by pid {alive.pid}"):
            RunLock.acquire(tmp_path)
    finally:
        alive.communicate(b"")
    with caplog.at_level(logging.WARNING, logger="trainer.engine.run_lock"):
        lock = RunLock.acquire(tmp_path)  # the same pid, now dead
    warnings = warnings_of(caplog)
    assert len(warnings) == 2 and "advisory only" in warnings[0] and f"pid {alive.pid}" in warnings[1], warnings
    lock.release()


def test_the_lock_is_released_when_a_run_ends_and_when_it_fails(tmp_path, fresh_accelerate_state):
    import trainer.sft as sft

    out = tmp_path / "run"
    sft.main(sft_argv(out, "--max_steps", "1", "--save_every", "0"))
    assert (out / "adapter").is_dir() and not (out / LOCK_FILE).exists()
    # A failure after the lock was taken (no adapter to start from): the process's exit frees the folder. The lock
    # file left there (claiming nothing) goes only with a lock this run took.
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / LOCK_FILE).write_text("{}")
    failed = run_sft(tmp_path / "failed", "--init_adapter", str(tmp_path / "no-adapter"))
    assert failed.returncode == 1 and "--init_adapter" in failed.stderr and "is not a saved adapter" in failed.stderr
    assert not (tmp_path / "failed" / LOCK_FILE).exists()


# ---- a full disk or a kill while saving ------------------------------------------------------------

@pytest.mark.parametrize("failure, reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "a file write failed"),
    (RuntimeError("basic_ios::clear: iostream error"), "a file write failed"),  # a 1 MiB tmpfs (issue 44)
], ids=["oserror", "torch-zip-writer", "torch-iostream"])
def test_a_full_disk_while_checkpointing_stops_in_one_line_and_keeps_the_previous_checkpoint(
        failure, reason, tmp_path, monkeypatch, capsys, fresh_accelerate_state):

    real_save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):
        if "checkpoint-0000004" in str(f) and str(f).endswith("optimizer.pt"):
            raise failure
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_save)
    out = tmp_path / "run"
    line = sft_error_line(capsys, out, "--max_steps", "4", "--save_every", "2")
    assert line.startswith(f"error: {out / 'checkpoint-0000004'}: could not be written ({reason}; ")
    assert "GiB free there); checkpoint-0000002 is intact; free space and rerun to resume" in line
    assert not (out / "checkpoint-0000004.tmp").exists() and not (out / "adapter").exists()
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-0000002"]
    verify_checkpoint(out / "checkpoint-0000002")


def test_a_full_disk_at_the_lock_or_the_metrics_stops_in_one_line(tmp_path, monkeypatch, capsys,
                                                                  fresh_accelerate_state):
    """No room for the lock file's few bytes, or for a line of metrics.jsonl (2 KB / 8 KB free): one line naming
    the file, no traceback (closing the lock file, whose buffered name cannot be flushed either, adds none)."""
    import builtins

    import trainer.engine.run_lock as run_lock
    import trainer.sft as sft
    from trainer.engine.run_lock import RunLock, RunLocked

    class FullFile:
        def __init__(self, file):
            self.file = file

        def __getattr__(self, name):
            return getattr(self.file, name)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):  # the name it still buffers cannot be written either
            self.file.close()
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = run_lock._open_lock_file
    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(run_lock, "_open_lock_file", lambda path, folder: FullFile(real_open(path, folder)))
    with pytest.raises(RunLocked, match=r"--output_dir .*: cannot write its lock file .*run.lock \(No space left on "
                                        r"device\)"):
        RunLock.acquire(tmp_path / "locked")
    with pytest.raises(SystemExit) as stop:
        run(sft.main, sft_argv(tmp_path / "locked"))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and error_lines(err) == [
        f"error: --output_dir {tmp_path / 'locked'}: cannot write its lock file {tmp_path / 'locked' / LOCK_FILE} "
        "(No space left on device); free space, or pick another --output_dir"], err[-2000:]
    monkeypatch.undo()

    real_builtin_open = builtins.open

    def full_metrics(file, mode="r", *args, **kwargs):
        if str(file).endswith("metrics.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_builtin_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_metrics)
    out = tmp_path / "run"
    line = sft_error_line(capsys, out, "--max_steps", "2", "--save_every", "0")
    assert line.startswith(f"error: {out / 'metrics.jsonl'}: could not be written (No space left on device; ")


def test_a_full_disk_while_saving_the_final_adapter_stops_in_one_line_and_leaves_no_half_adapter(
        tmp_path, monkeypatch, capsys, fresh_accelerate_state):
    import foundation.files as files

    real_fsync = files.fsync_tree

    def full_disk_fsync(root):
        if Path(root).name.startswith(".adapter-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(root)

    monkeypatch.setattr(files, "fsync_tree", full_disk_fsync)
    out = tmp_path / "run"
    line = sft_error_line(capsys, out, "--max_steps", "1", "--save_every", "0")
    assert line.startswith(f"error: the final adapter in {out}: could not be written (No space left on device; ")
    assert not [p for p in out.iterdir() if p.name.startswith((".adapter", "adapter"))]


def test_a_kill_during_the_final_save_leaves_debris_the_next_run_removes(tmp_path, fresh_accelerate_state, capsys,
                                                                         forks):
    from trainer.engine.setup import start_run
    from trainer.sft import SFTArguments

    out, killed_log = tmp_path / "run", tmp_path / "killed.log"
    # killed once the final adapter is written under its temporary name, before the rename
    killed_run(forks, "trainer.sft", sft_argv(out, "--max_steps", "2", "--save_every", "2"), killed_log,
               die_at=".adapter-")
    assert len([p for p in out.iterdir() if p.name.startswith(".adapter-")]) == 1
    ctx = start_run(SFTArguments, sft_argv(out, "--max_steps", "2"), stage="sft")
    assert not [p for p in out.iterdir() if p.name.startswith(".adapter-")]
    assert ctx.resume_from == out / "checkpoint-0000002"
    log = capsys.readouterr().out  # the run's own log handler (setup_logging) writes to stdout
    assert len([line for line in log.splitlines() if "WARNING" in line and "taking over the lock" in line]) == 1
    ctx.lock.release()


# ---- weights that can no longer train ------------------------------------------------------------

@pytest.mark.parametrize("extra, problem", [
    (["--learning_rate", "1e30"], "a trainable weight of 3.33e+29 (past 1.8e+19, a forward through it overflows)"),
    (["--learning_rate", "1e30", "--weight_decay", "1e10"], "NaN/inf trainable weights"),
], ids=["overflowing", "nan"])
def test_an_optimizer_step_that_breaks_the_weights_stops_the_run_before_anything_saves_them(
        extra, problem, tmp_path, capsys, fresh_accelerate_state):

    out = tmp_path / "run"
    line = sft_error_line(capsys, out, "--max_steps", "3", "--save_every", "1", *extra)
    assert line.startswith(f"error: step 1: the optimizer step left {problem}, with --learning_rate 1e+30")
    assert not (out / "adapter").exists() and complete_checkpoints(out) == []


def test_the_final_save_refuses_weights_that_are_not_finite_even_if_a_step_let_them_through(
        tmp_path, monkeypatch, capsys, fresh_accelerate_state):
    from trainer.engine.harness import Engine

    monkeypatch.setattr(Engine, "check_parameters", lambda self: None)
    out = tmp_path / "run"
    line = sft_error_line(capsys, out, "--max_steps", "1", "--save_every", "0", "--learning_rate", "1e30",
                          "--weight_decay", "1e10")
    assert line == f"error: the trained adapters hold NaN/inf trainable weights: not saved to {out / 'adapter'}"
    assert not (out / "adapter").exists()


def test_largest_weight_is_the_largest_magnitude_over_all_tensors_and_nan_wins():
    from trainer.engine.metrics import WEIGHT_LIMIT, largest_weight, unusable_weights

    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t)
    weights = [torch.tensor([0.5, -3.0]), torch.tensor([[2.0]], dtype=torch.float64), torch.zeros(0)]
    assert largest_weight(acc, weights) == 3.0 and unusable_weights(3.0) is None
    assert torch.isnan(torch.tensor(largest_weight(acc, [*weights, torch.tensor([1.0, float("nan")])])))
    assert largest_weight(acc, [*weights, torch.tensor([-float("inf")])]) == float("inf")
    assert unusable_weights(float("nan")) == unusable_weights(float("inf")) == "NaN/inf trainable weights"
    assert unusable_weights(WEIGHT_LIMIT) is None and unusable_weights(WEIGHT_LIMIT * 2) is not None
    assert largest_weight(acc, [torch.zeros(0)]) == 0.0  # a ZeRO-3 rank without whole parameters


# ---- sampling under which the policy can hardly learn ---------------------------------------------

def test_sampling_that_can_learn_but_hardly_is_warned_about_once(caplog):
    from foundation.settings import GRPOArguments, PPOArguments
    from trainer.grpo import check_settings as grpo_settings
    from trainer.ppo import check_settings as ppo_settings

    cases = [(ppo_settings, PPOArguments(scripted_reward="length:5", temperature=5.0), "--temperature 5.0: "),
             (ppo_settings, PPOArguments(scripted_reward="length:5", temperature=0.0), "--temperature 0 (greedy)"),
             (grpo_settings, GRPOArguments(scripted_reward="length:5", temperature=5.0, mini_batch_size=8),
              "--temperature 5.0: ")]
    for check, args, text in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            check(args)
        warnings = warnings_of(caplog)
        assert len(warnings) == 1 and text in warnings[0], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ppo_settings(PPOArguments(scripted_reward="length:5"))
    assert warnings_of(caplog) == []


# ---- a run that runs out of memory ---------------------------------------------------------------------

def test_a_run_out_of_memory_keeps_its_memory_record_saying_where_it_stopped(tmp_path, monkeypatch, capsys,
                                                                             fresh_accelerate_state):
    """Out of memory in step 2's generation (as under a card's cap, the GPU kit's 12 GB and 8 GB runs): one line
    saying where and what to change; memory.json still holds step 1's phases and says where the run stopped, and
    the GPU tables mark that phase."""
    import trainer.grpo as grpo
    from benchmarks.gpu.collect import memory_rows
    from benchmarks.gpu.vs_estimate import compare
    from trainer.model.decode import Generator

    real_sample, calls = Generator.sample, []

    def decode_out_of_memory_at_the_second_rollout(*args, **kwargs):  # two decodes a rollout: 16 rows, 8 a pass
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(Generator, "sample", decode_out_of_memory_at_the_second_rollout)
    out = tmp_path / "result" / "grpo"
    with pytest.raises(SystemExit) as exit_info:
        run(grpo.main, ["--config", str(ROOT / "tests" / "configs" / "tiny_grpo.yaml"), "--output_dir", str(out),
                        "--max_steps", "3", "--save_every", "0", "--eval_prompts", "0", "--profile_memory", "true"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err and len(calls) == 3
    assert error_lines(err) == [
        "error: out of memory at step 2, in phase generate (CUDA out of memory. Tried to allocate 2.00 GiB): set "
        "--memory_budget_gib (now 24) to what the card leaves free, which the start-up check then holds the run to, "
        "or lower --micro_batch_size, --rollout_micro_batch_size or --generation_weights quantized; the phases "
        f"recorded until then: {out / 'memory.md'}"]
    memory = json.loads((out / "memory.json").read_text())
    assert memory["ended"] == {"step": 2, "stage": "grpo", "phase": "generate",
                               "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert {"generate", "score", "update", "optimizer_step"} <= {p["phase"] for p in memory["phases"]}
    assert ("**The run stopped at step 2, in phase generate: OutOfMemoryError: CUDA out of memory. Tried to "
            "allocate 2.00 GiB**") in (out / "memory.md").read_text()
    rows = memory_rows(out.parent)
    stopped = [row for row in rows if "stopped here" in row]
    assert len(stopped) == 1 and "| generate **(stopped here at step 2: OutOfMemoryError: CUDA out of memory." in \
        stopped[0]
    compared = compare(out)
    assert compared["ended"] == memory["ended"] and "The run stopped at step 2" in (out / "vs_estimate.md").read_text()


def test_out_of_memory_without_a_memory_record_is_one_line_and_still_an_out_of_memory_error(
        tmp_path, monkeypatch, capsys, fresh_accelerate_state):
    """SFT out of memory in step 2's optimizer step, not recording memory: the line names the phase and the flag
    that would record it; the error is still torch's OutOfMemoryError to code that catches those (a benchmark's
    side), and an error that is not about memory is raised as it was."""
    import trainer.sft as sft
    from trainer.engine.harness import OutOfMemory

    real_step, calls = torch.optim.AdamW.step, []

    def step_out_of_memory_at_the_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_out_of_memory_at_the_second)
    out = tmp_path / "run"
    line = sft_error_line(capsys, out, "--max_steps", "3", "--save_every", "0", "--optimizer", "adamw_torch")
    assert line == ("error: out of memory at step 2, in phase optimizer_step (CUDA error: out of memory): set "
                    "--memory_budget_gib (now 24) to what the card leaves free, which the start-up check then holds "
                    "the run to, or lower --micro_batch_size; --profile_memory true records each phase")
    assert not (out / "memory.json").exists() and issubclass(OutOfMemory, torch.OutOfMemoryError)
    calls.clear()
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (_ for _ in ()).throw(KeyError("state")))
    with pytest.raises(KeyError):
        sft.main(sft_argv(tmp_path / "other", "--max_steps", "1", "--save_every", "0", "--optimizer", "adamw_torch"))


@pytest.mark.parametrize("stage, where, check, profile, rank, expected", [
    ("sft", "evaluate", True, False, 0, "at step 3, in phase evaluate (CUDA out of memory): set --memory_budget_gib "
     "(now 12) to what the card leaves free, which the start-up check then holds the run to, or lower "
     "--eval_batch_size; --profile_memory true records each phase"),
    ("ppo", "score", True, True, 0, "at step 3, in phase score (CUDA out of memory): set --memory_budget_gib (now 12) "
     "to what the card leaves free, which the start-up check and plan then hold the run to, or lower "
     "--micro_batch_size, --rollout_micro_batch_size"),
    ("dpo", None, False, True, 1, "at step 3 (CUDA out of memory): lower --micro_batch_size"),
], ids=["sft-evaluate", "ppo-planned", "dpo-unchecked-rank-1"])
def test_the_out_of_memory_line_names_what_the_stage_and_phase_can_change(stage, where, check, profile, rank, expected,
                                                                          caplog):
    """The flags the line names are the stage's and the phase's; the budget only where the start-up check reads
    it, the plan only where one is made (PPO / GRPO on CUDA); a rank other than the first logs its line."""
    from trainer.engine.harness import Harness

    accelerator = SimpleNamespace(device=torch.device("cuda"), is_main_process=rank == 0, process_index=rank)
    harness = SimpleNamespace(stage=stage, step=3, accelerator=accelerator,
                              ctx=SimpleNamespace(stage_args=SimpleNamespace(auto_fit=None)),
                              args=SimpleNamespace(memory_budget_gib=12.0, check_budget=check, profile_memory=profile))
    with caplog.at_level(logging.ERROR, logger="trainer.engine.harness"):
        line = Harness._out_of_memory(harness, torch.OutOfMemoryError("CUDA out of memory"), where, None)
    assert line == "out of memory " + expected
    assert [r.getMessage() for r in caplog.records] == ([f"rank 1: {line}"] if rank else [])


def test_an_error_names_the_innermost_phase_it_left_or_the_error_it_was_raised_from():
    from trainer.engine.phases import phase, raised_in

    with pytest.raises(InterruptedError) as raised:
        with phase("update"):
            with phase("optimizer_step"):
                raise InterruptedError("stop")
    assert raised_in(raised.value) == "optimizer_step"
    try:  # raised from an error a phase left: that phase; one raised outside every phase: none
        try:
            with phase("generate"):
                raise torch.OutOfMemoryError("out")
        except torch.OutOfMemoryError:
            raise ValueError("retried and gave up") from None
    except ValueError as exc:
        assert raised_in(exc) == "generate"
    assert raised_in(KeyError()) is None
    first, second = ValueError("a"), ValueError("b")  # a cycle of causes ends the walk
    first.__cause__, second.__cause__ = second, first
    assert raised_in(first) is None
