"""The process user reward functions run in: the trainer survives whatever they do.

`RewardWorker` starts this module's `main` in a child Python once per run; the child imports the files and modules
`--reward_fn` names and calls their functions on batches the trainer sends over a pipe. A function that exits
(`os._exit` included), hangs past `--reward_timeout_s` (the child is killed: a thread cannot stop a catastrophic
regex), raises anything or returns what cannot be a reward ends the run with one line (`RewardFunctionError`),
never silently and never with a traceback. Each call unpickles its own copy of the rows, so a function that edits
them in place changes nothing the next one sees. The worker leads its own process group: a kill ends what the
function started too. This module imports only the standard library and foundation.cli, so the child's start-up
is the interpreter's.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional, Sequence

from foundation.cli import UsageError

FLOAT32_MAX = 3.4028234663852886e38  # scores are float32 tensors
# A reward (after its weight) must stay below this: past it, float32 sums of squares over a batch (a group's
# variance, a value loss) overflow, and a run would log infinite statistics instead of learning.
REWARD_LIMIT = 1e15
LOAD_TIMEOUT_S = 600.0  # importing a file (numpy, transformers ...) may take longer than a call is allowed
_WAIT_LIMIT_S = 1e6  # the longest wait a pipe's poll takes (past ~2.1e6 s it raises)
_START = ("import sys; del sys.path[0]; "  # the current folder is the user's: a trainer.py there must not shadow ours
          "from trainer.rl.reward_worker import main; main(sys.argv[1:])")


class RewardFunctionError(UsageError):
    """A reward function that cannot be imported, failed, or returned what cannot be a reward; one line."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL hands a reward function as `trainer_state`: the optimizer steps done, of how many, and the epoch."""

    global_step: int
    max_steps: int
    epoch: float

    @classmethod
    def before_step(cls, step_number: int, max_steps: int, prompts_per_step: int, prompts: int) -> "TrainerState":
        """The state while step `step_number` (1, 2, ...) scores its rollout: the steps done, the epoch reached."""
        done = step_number - 1
        return cls(global_step=done, max_steps=max_steps, epoch=done * prompts_per_step / max(prompts, 1))


def one_line(text: Any) -> str:
    try:
        return " ".join(str(text).split())[:300]
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises: its type is what we can say
        return f"<{type(text).__name__}>"


def _shown(value: Any, width: int) -> str:
    try:
        return one_line(repr(value))[:width]
    except Exception:  # noqa: BLE001 - a repr that raises names the type only
        return f"<{type(value).__name__}>"


def checked_values(who: str, weight: float, values: Any, sources: Sequence[str]) -> list[Optional[float]]:
    """`values` as one float or None per source, each within REWARD_LIMIT times its weight, or a
    RewardFunctionError naming `who` and the row. Runs where the function ran (the child, for user code)."""
    count = len(sources)
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(f"{who} returned {type(values).__name__}, not a list of {count} values "
                                  f"(rows {sources[0]} ...)")
    if len(values) != count:
        raise RewardFunctionError(f"{who} returned {len(values)} values for {count} completions (rows "
                                  f"{sources[0]} ...)")
    out: list[Optional[float]] = []
    for value, source in zip(values, sources):
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy or torch scalar (numpy's bool too)
            value = value.item()
        if value is not None and not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"{who} returned {type(value).__name__} {_shown(value, 60)}, not a number, "
                                      f"for row {source}")
        if value is not None:
            try:
                value = float(value)
            except OverflowError:  # an int past any float
                raise RewardFunctionError(f"{who} returned {_shown(value, 40)}..., past float32's range, for row "
                                          f"{source}") from None
            except Exception as exc:  # noqa: BLE001 - a number type whose __float__ fails
                raise RewardFunctionError(f"{who} returned {type(value).__name__} {_shown(value, 60)} whose float() "
                                          f"raised {type(exc).__name__}: {one_line(exc)}, for row {source}") from None
            if not math.isfinite(value):
                raise RewardFunctionError(f"{who} returned {value} for row {source}")
            if abs(value) > FLOAT32_MAX:
                raise RewardFunctionError(f"{who} returned {value:g}, past float32's range, for row {source}")
            if abs(value * weight) > REWARD_LIMIT:
                times = f" times its weight {weight:g}" if weight != 1 else ""
                raise RewardFunctionError(f"{who} returned {value:g}{times}, past +-{REWARD_LIMIT:g} (float32 "
                                          f"variances and value losses overflow there), for row {source}")
        out.append(value)
    return out


# ---- the trainer's side -----------------------------------------------------------------------------------

class RewardWorker:
    """The child process holding the user's reward functions; `load` each, `call` them, `close` at the end."""

    def __init__(self) -> None:
        to_child, requests = os.pipe()
        replies, from_child = os.pipe()
        root = str(Path(__file__).resolve().parents[2])  # the trainer package importable wherever the run started
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _START, str(to_child), str(from_child), str(os.getpid())],
            stdin=subprocess.DEVNULL, pass_fds=(to_child, from_child), env=env, start_new_session=True)
        os.close(to_child)
        os.close(from_child)
        self.requests = Connection(requests, readable=False)
        self.replies = Connection(replies, writable=False)
        self.requests.send(("path", list(sys.path)))  # a module named by --reward_fn resolves as it would here

    def _ask(self, message: tuple, timeout_s: float) -> tuple:
        """The child's reply to `message`: ("gone", exit code) if it died, ("late",) past `timeout_s` (killed)."""
        try:
            self.requests.send(message)
            if not self.replies.poll(min(timeout_s, _WAIT_LIMIT_S)):
                self.close(kill=True)
                return ("late",)
            return self.replies.recv()
        except (EOFError, OSError):
            self.close(kill=True)  # gone already; its group may not be
            return ("gone", self.process.returncode)

    def load(self, spec: str, target: str, name: str) -> tuple:
        """("ok",) once `target` is imported and has a function `name`, else ("error", what) / ("gone", code) /
        ("late",) past LOAD_TIMEOUT_S."""
        return self._ask(("load", spec, target, name), LOAD_TIMEOUT_S)

    def call(self, spec: str, who: str, weight: float, kwargs: dict, sources: Sequence[str],
             timeout_s: float) -> tuple:
        """("values", checked floats) | ("raised", type, text, failing row or None) | ("bad", what) | ("gone",
        exit code) | ("late",)."""
        reply = self._ask(("call", spec, who, weight, kwargs, list(sources)), timeout_s)
        if reply[0] == "raised":  # which row alone makes it raise: the child tries each, all in the time of one call
            found = self._ask(("find_row",), timeout_s)
            reply = (*reply, found[1] if found[0] == "row" else None)
        return reply

    def close(self, kill: bool = False) -> None:
        """End the worker: asked to (EOF on its pipe), or killed with its process group after 5 s or at once."""
        for end in (self.requests, self.replies):
            if not end.closed:
                end.close()
        if not kill:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # what the function started, and the worker if it still runs
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


# ---- the child's side -------------------------------------------------------------------------------------

def _die_with(parent: int) -> None:
    """Linux: the kernel kills this process when the trainer dies (even by SIGKILL); elsewhere EOF on the pipe."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the trainer died before the call above
        os._exit(0)


def _import(target: str):
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {target}")
    name = f"_reward_fn_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module


def _serve(requests: Connection, replies: Connection) -> None:
    modules: dict[str, Any] = {}
    functions: dict[str, Any] = {}
    last: Optional[tuple] = None  # (function, kwargs, sources) of the call that raised, for find_row
    while True:
        try:
            message = requests.recv()
        except EOFError:
            return
        kind = message[0]
        if kind == "path":
            sys.path[:] = message[1]
        elif kind == "load":
            _, spec, target, name = message
            try:
                if target not in modules:
                    modules[target] = _import(target)
            except FileNotFoundError as exc:
                replies.send(("error", str(exc)))
                continue
            except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt at import too
                replies.send(("error", f"cannot import {target}: {type(exc).__name__}: {one_line(exc)}"))
                continue
            try:
                fn = getattr(modules[target], name, None)
            except BaseException:  # noqa: BLE001 - a module __getattr__ that raises
                fn = None
            if not callable(fn):
                replies.send(("error", f"{target} has no function {name}"))
                continue
            functions[spec] = fn
            replies.send(("ok",))
        elif kind == "call":
            _, spec, who, weight, kwargs, sources = message
            fn = functions[spec]
            try:
                values = fn(**copy.deepcopy(kwargs))
            except BaseException as exc:  # noqa: BLE001 - whatever it raises is the trainer's one line
                last = (fn, kwargs, sources)
                replies.send(("raised", type(exc).__name__, one_line(exc)))
                continue
            try:
                replies.send(("values", checked_values(who, weight, values, sources)))
            except RewardFunctionError as exc:
                replies.send(("bad", str(exc)))
            except BaseException as exc:  # noqa: BLE001 - what it returned fails to convert or to send
                replies.send(("bad", f"{who} returned {type(values).__name__}, which could not be read as "
                                     f"{len(sources)} rewards ({type(exc).__name__}: {one_line(exc)})"))
        elif kind == "find_row":
            replies.send(("row", _failing_row(*last) if last else None))


def _failing_row(fn, kwargs: dict, sources: Sequence[str]) -> Optional[str]:
    """The first row on which `fn` raises when called with that row alone (None: none does)."""
    for i, source in enumerate(sources):
        try:
            fn(**{key: copy.deepcopy(values[i : i + 1]) if isinstance(values, list) else values
                  for key, values in kwargs.items()})
        except BaseException:  # noqa: BLE001
            return source
    return None


def main(argv: Sequence[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it closes this process
    requests_fd, replies_fd, parent = (int(a) for a in argv)
    _die_with(parent)
    replies = Connection(replies_fd, readable=False)
    _serve(Connection(requests_fd, writable=False), replies)


if __name__ == "__main__":
    main(sys.argv[1:])
