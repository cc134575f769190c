"""Shared fixtures: the real hh-rlhf rows from ../shared and the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from foundation.settings import DATA_ENV
from trainer.config import SHARED_DATA

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile compiles in its own pool of worker processes: on two cores they would compete with the other
# test worker, which the pool is not told of
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU kernels without SIMD: the tests that run inductor claim its graph passes and what its kernels compute
# (on a GPU, Triton's); vectorised C++ is much slower to generate and compile, and no GPU runs it
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# The workers' garbage collector runs every 10,000 net allocations, not 700: torch.compile's tracing allocates
# millions of short-lived objects, and each collection walks the young ones among a heap of torch and transformers
gc.set_threshold(10_000)

# Under pytest-xdist (make test runs files on parallel workers) the workers share the cores: each
# one, and every process it starts, gets its share of threads instead of all of them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may be imported already


# What a run imports, every stage and what they load on their way: most of a tiny run's time.
FORK_PRELOAD = [*(f"trainer.{stage}" for stage in ("sft", "reward", "dpo", "ppo", "grpo")), "benchmarks.row_trace",
                "peft", "bitsandbytes", "deepspeed", "transformers.models.llama.modeling_llama",
                "transformers.conversion_mapping"]


@pytest.fixture(scope="session")
def forks():
    """Processes forked from one that imported `FORK_PRELOAD` once (multiprocessing's forkserver, one per test
    worker): a run that is killed, or runs under a file-size limit, gets a process of its own without importing
    torch, transformers and the rest again. A target is a module-level function (`run_to_be_killed`,
    `limited_run`'s)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_PRELOAD)
    return context


def run_to_be_killed(module: str, argv: list[str], log: Path, die_at: str | None = None,
                     trace: Path | None = None) -> None:
    """The body of a process that is killed (a `forks` target): `python -m MODULE ARGV` with one thread, as the
    runs in the test's process (a matrix product's summation order may change with the thread count), its output
    into `log`. With `die_at` it SIGKILLs itself when it syncs a folder whose name starts so: every file of that
    save written, nothing renamed yet. With `trace` the rows each step reads are recorded from outside the trainer."""
    import signal
    from contextlib import ExitStack, redirect_stderr, redirect_stdout

    import foundation.files as files

    real = files.fsync_tree

    def dying_fsync(root: Path) -> None:
        if die_at is not None and root.name.startswith(die_at):
            os.kill(os.getpid(), signal.SIGKILL)
        real(root)

    files.fsync_tree = dying_fsync
    torch.set_num_threads(1)
    with open(log, "w") as f, redirect_stdout(f), redirect_stderr(f), ExitStack() as stack:
        if trace is not None:
            from benchmarks.row_trace import traced

            stack.enter_context(traced(trace))
        in_process(module, argv)


def _under_a_file_size_limit(module: str, argv: list[str], limit: int, stdout, stderr) -> None:
    """The body of `limited_run`'s process: its stdout and stderr are the pipes, then `ulimit -f` (a pipe is not a
    file: what the run prints is not cut), then the run (`in_process`), and the exit handlers an interpreter runs
    as it exits (a forked process leaves without them)."""
    import atexit
    import resource
    import signal
    import sys

    for stream, pipe in ((sys.stdout, stdout), (sys.stderr, stderr)):
        stream.flush()
        os.dup2(pipe.fileno(), stream.fileno())
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ kills the writer
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    torch.set_num_threads(1)
    try:
        in_process(module, argv)
    finally:
        atexit._run_exitfuncs()


def limited_run(forks, module: str, argv: list[str], file_size: int):
    """`python -m MODULE ARGV` under `ulimit -f` of `file_size` bytes, in a process forked from `forks`: as
    `subprocess.run(capture_output=True, text=True)` sees it (exit code, stdout, stderr), without the start of a
    process of its own."""
    import selectors
    import subprocess

    pipes = {"stdout": forks.Pipe(duplex=False), "stderr": forks.Pipe(duplex=False)}
    proc = forks.Process(target=_under_a_file_size_limit,
                         args=(module, argv, file_size, pipes["stdout"][1], pipes["stderr"][1]))
    proc.start()
    out, selector = {name: b"" for name in pipes}, selectors.DefaultSelector()
    for name, (reader, writer) in pipes.items():
        writer.close()  # the child's copy stays open until it ends
        selector.register(reader.fileno(), selectors.EVENT_READ, name)
    while selector.get_map():
        for key, _ in selector.select():
            chunk = os.read(key.fd, 65536)
            if chunk:
                out[key.data] += chunk
            else:
                selector.unregister(key.fd)
    proc.join(600)
    return subprocess.CompletedProcess([module, *argv], proc.exitcode, out["stdout"].decode(), out["stderr"].decode())


def killed_run(forks, module: str, argv: list[str], log: Path, die_at: str) -> None:
    """`run_to_be_killed` in a process of its own, which must end by its SIGKILL at `die_at`."""
    import signal

    proc = forks.Process(target=run_to_be_killed, args=(module, argv, log, die_at))
    proc.start()
    proc.join(600)
    assert proc.exitcode == -signal.SIGKILL, log.read_text()[-3000:]


def _folder_state(source) -> tuple | None:
    """(name, size, mtime) of each file in `source`, a folder; None for anything else (a hub id, a file)."""
    try:
        files = [entry for entry in os.scandir(source) if entry.is_file()]
        return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    except (OSError, TypeError):
        return None


def _backend_state(tokenizer) -> tuple:
    """What a run could change in a tokenizer's Rust backend: added tokens, padding, truncation, its pipeline."""
    backend = tokenizer._tokenizer
    return (backend.get_vocab_size(with_added_tokens=True), backend.padding, backend.truncation,
            *(getattr(part, "__getstate__", lambda: None)() for part in
              (backend.normalizer, backend.pre_tokenizer, backend.post_processor, backend.decoder)))


@pytest.fixture(scope="session", autouse=True)
def tokenizers_parsed_once():
    """`AutoTokenizer.from_pretrained` of a folder parses its tokenizer.json once per test worker: every in-process
    run loads its tokenizer, and the parse (JSON in Python, then again in Rust) is ~0.3 s of CPU each time, a tenth
    of the suite. A later load of the same folder, unchanged, with the same arguments gets a deep copy of the first
    whose Rust backend is the first's. The copies handed out share that backend: a test that changes a loaded
    tokenizer's backend (adds tokens, sets its pipeline) changes theirs too, and the next load is parsed anew
    (`_backend_state`). Errors and anything but a folder load as before."""
    import copy

    from transformers import AutoTokenizer

    loaded, real = {}, AutoTokenizer.from_pretrained

    def from_pretrained(source, *args, **kwargs):
        state = _folder_state(source)
        key = (str(source), repr(args), repr(sorted(kwargs.items())), state)
        held = loaded.get(key) if state is not None else None
        if held is None or _backend_state(held[0]) != held[1]:
            tokenizer = real(source, *args, **kwargs)
            if state is None or getattr(tokenizer, "_tokenizer", None) is None:
                return tokenizer
            held = loaded[key] = (tokenizer, _backend_state(tokenizer))
        return copy.deepcopy(held[0], {id(held[0]._tokenizer): held[0]._tokenizer})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
        yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Folder of the real hh-rlhf rows ($RLHF_DATA, else ../shared/data/hh-rlhf)."""
    path = Path(os.environ.get(DATA_ENV) or SHARED_DATA)
    if not path.exists():
        pytest.fail(f"hh-rlhf rows not found at {path}; set ${DATA_ENV}")
    return path


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (converted from the package's GGUF, cached)."""
    from trainer.model.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture
def learning_run(tmp_path):
    """Run `trainer/STAGE.py --config CONFIG` in this process with one thread (`in_process_command`, as
    benchmarks.learning_margin's one-thread runs) and return (results.json, run folder): the learning checks of
    PPO and GRPO on the embedded SmolLM2."""
    import json

    def run(stage: str, config: str) -> tuple[dict, Path]:
        out = tmp_path / stage
        proc = in_process_command(f"trainer.{stage}", ["--config", str(Path(__file__).resolve().parent.parent / config),
                                                       "--output_dir", str(out)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((out / "results.json").read_text()), out

    return run


@pytest.fixture
def fresh_accelerate_state():
    """In-process runs each make an Accelerator; forget the singletons of the previous one."""
    from trainer.engine.launch import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()


def in_process(module: str, argv: list[str]):
    """`python -m MODULE ARGV` in this process: its `main` through `foundation.cli.run` (our errors end in one
    line and SystemExit), with fresh Accelerate singletons before and after. For module-scoped fixtures too."""
    import importlib

    from foundation.cli import run
    from trainer.engine.launch import reset_accelerate

    reset_accelerate()
    try:
        return run(importlib.import_module(module).main, argv)
    finally:
        reset_accelerate()


def in_process_command(module: str, argv: list[str]):
    """`in_process` as `subprocess.run(capture_output=True)` of `python -m MODULE ARGV` with OMP_NUM_THREADS=1 sees
    it: one torch thread (a matrix product's summation order may change with the thread count), stdout and stderr
    captured, the exit code of our one-line errors (0 when `main` returns). Without a process start, which costs a
    tiny run most of its time (importing torch, transformers, bitsandbytes)."""
    import io
    import subprocess
    from contextlib import redirect_stderr, redirect_stdout

    out, err, threads, code = io.StringIO(), io.StringIO(), torch.get_num_threads(), 0
    torch.set_num_threads(1)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            in_process(module, argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([module, *argv], code, out.getvalue(), err.getvalue())


def plant_remote_code(folder: Path, marker: Path, config_file: str) -> str:
    """`folder` (a model's or tokenizer's files) with its `config_file` naming (auto_map) a module that, imported,
    writes `marker`: config.json a model of a type transformers does not know, tokenizer_config.json a tokenizer
    class it does not know. What the trust_remote_code checks load, to see that nothing runs."""
    import json

    (folder / "custom.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    if config_file == "config.json":
        values = {"model_type": "custom", "auto_map": {"AutoConfig": "custom.Config",
                                                       "AutoModelForCausalLM": "custom.Model"}}
    else:
        values = {**json.loads((folder / config_file).read_text()), "tokenizer_class": "CustomTokenizer",
                  "auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}}
    (folder / config_file).write_text(json.dumps(values))
    return str(folder)


def saved_head(folder: Path, hidden_size: int, seed: int = 0) -> str:
    """A folder holding a random scalar head (head.safetensors): what a frozen head must be loaded from."""
    import torch

    from trainer.model.adapter_fit import HEAD_FILE
    from trainer.model.shared_base import ScalarHead

    torch.manual_seed(seed)
    Path(folder).mkdir(parents=True, exist_ok=True)
    ScalarHead(hidden_size).save(Path(folder) / HEAD_FILE)
    return str(folder)


def dispatch_counter(counted):
    """A TorchDispatchMode that counts, in `.count`, the operations torch dispatches inside it for which
    `counted(func)` is true (func: the aten overload)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += bool(counted(func))
            return func(*args, **(kwargs or {}))

    return Counter()


def adapter_state(model, name: str) -> dict[str, torch.Tensor]:
    """Detached copies of adapter `name`'s LoRA weights (and head) in a shared-base model, to compare before and
    after a step."""
    from peft import get_peft_model_state_dict

    lora = get_peft_model_state_dict(model.peft, adapter_name=name, save_embedding_layers=False)
    state = {k: v.detach().clone() for k, v in lora.items()}
    if name in model.heads:
        state.update({f"head.{k}": v.detach().clone() for k, v in model.heads[name].state_dict().items()})
    return state


@contextmanager
def base_only(model):
    """The body runs on the frozen base of a shared-base model: every adapter's LoRA-B is zeroed, so each LoRA
    layer adds exactly nothing, and restored after. Switching and trainability are untouched."""
    weights = [b.weight for layer in model.lora_layers for b in layer.lora_B.values()]
    kept = [w.detach().clone() for w in weights]
    with torch.no_grad():
        for w in weights:
            w.zero_()
    try:
        yield model
    finally:
        with torch.no_grad():
            for w, k in zip(weights, kept):
                w.copy_(k)


def dense_copies_made(monkeypatch) -> list:
    """Every dense copy of a 4-bit layer (`trainer.model.decode_weights.DequantizedLinear`) made from now on, in
    order."""
    from trainer.model import decode_weights

    made = []

    class Made(decode_weights.DequantizedLinear):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(decode_weights, "DequantizedLinear", Made)
    return made


# The slowest files first: `make test` hands whole files to two workers in collection order, so a long
# file that starts last would run on alone while the other worker idles. The distributed launches (two
# processes) come after the other worker's first two files, so they do not share two cores with the GPU kit's
# smoke runs.
SLOW_FIRST = ("test_gpu_kit.py", "test_decode.py", "test_shared_base.py", "test_distributed.py", "test_ppo_learning.py",
              "test_benchmarks.py", "test_resume.py", "test_grpo_learning.py", "test_stages.py", "test_stages_vs_trl.py",
              "test_profiling_live.py", "test_reward_functions.py", "test_pipeline.py", "test_file_modes.py",
              "test_training.py", "test_profiling_estimate.py", "test_plan.py", "test_checkpoints.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


@contextmanager
def compiled_calls(monkeypatch):
    """Yields a list that gets one entry per call into a --compile_layers part's compiled forward (what
    `trainer.model.compiled.CompiledLayer` dispatches while autograd records)."""
    from trainer.model.compiled import CompiledLayer

    calls, original = [], CompiledLayer.__call__

    def counted(self, *args, **kwargs):
        if torch.is_grad_enabled():
            calls.append(1)
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(CompiledLayer, "__call__", counted)
        yield calls


class Payload:
    """Unpickling this creates a folder: proof that loading ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


@pytest.fixture
def traced_not_generated(monkeypatch):
    """torch.compile with the aot_eager backend: dynamo traces (graphs, breaks, regions, guards, recompiles) and
    AOTAutograd partitions as under inductor, and the graphs then run eagerly, with no C++ code generated and
    compiled. For tests whose claim is about tracing or the code around it, not inductor's kernels (those a GPU
    run generates with Triton: tests/test_gpu.py); inductor's own passes are tested with inductor."""
    compile_ = torch.compile

    def aot_eager(model=None, *, options=None, backend="inductor", **kwargs):
        return compile_(model, backend="aot_eager", **kwargs) if model is not None else (
            lambda fn: compile_(fn, backend="aot_eager", **kwargs))

    monkeypatch.setattr(torch, "compile", aot_eager)
