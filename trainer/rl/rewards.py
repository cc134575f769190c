"""The score of a response: the reward adapter's (weight 1) plus each reward function's value times its weight.

A reward function follows TRL's convention: it takes keyword arguments `prompts`, `completions` (decoded
text; for a conversational row `[{"role": "assistant", "content": text}]`), `completion_ids` and every other
column of the rows (e.g. `answer`), each a list with one entry per completion, and returns one float per
completion, or None where it does not apply (left out of its mean, 0 in the sum). Functions come only from
the settings (`--reward_fn PATH.py:NAME` or `package.module:NAME`); the toy rewards `keyword:WORD`,
`length:N` and `chars:N` are built-in functions of the same kind. A function that fails, exits, runs past
`--reward_timeout_s` or returns what is not a finite float32 (after its weight) stops the run with one line
naming it and the row (`RewardFunctionError`). Each function gets its own copies of the rows: what one
changes in place reaches neither the next function nor the dataset.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import logging
import math
import numbers
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from foundation.cli import UsageError
from foundation.settings import BUILTINS, check_builtin, check_spec, split_specs  # noqa: F401  (evaluate.py reads split_specs here)
from foundation.stages import REWARD
from trainer.rl.scoring import sequence_scores

logger = logging.getLogger(__name__)

RESERVED = ("prompts", "completions", "completion_ids")  # the call's own arguments: a column cannot replace them
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # scores are float32 tensors: a reward must fit one


class RewardFunctionError(UsageError):
    """A reward function that cannot be imported or returned what cannot be a reward; one line."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # its name in the metrics: rewards/NAME/mean
    fn: Callable[..., Any]
    weight: float = 1.0
    origin: str = "built-in"  # the file or module it was imported from


# ---- the built-ins ---------------------------------------------------------------------------------

def _text(completion) -> str:
    return completion if isinstance(completion, str) else "".join(m.get("content", "") for m in completion)


def builtin(spec: str, flag: str = "--reward_fn") -> RewardFunction:
    """`keyword:WORD` (1 when WORD is in the response, any case), `length:N` (-|tokens - N| / N, the EOS
    counted) or `chars:N` (-|characters - N| / N of the decoded text), as a reward function."""
    kind, arg = check_builtin(spec, flag)
    if kind == "keyword":
        word = arg.lower()
        return RewardFunction(kind, lambda completions, **_: [float(word in _text(c).lower()) for c in completions])
    n = int(arg)
    if kind == "length":
        return RewardFunction(kind, lambda completion_ids, **_: [-abs(len(ids) - n) / n for ids in completion_ids])
    return RewardFunction(kind, lambda completions, **_: [-abs(len(_text(c)) - n) / n for c in completions])


def _module_of(target: str, spec: str):
    """The module `target` names (a .py file, or a dotted module), or a RewardFunctionError in one line."""
    try:
        return _import_file(target, spec) if target.endswith(".py") else importlib.import_module(target)
    except RewardFunctionError:
        raise
    except (Exception, SystemExit) as exc:  # the user's code failed to import, or exited: named in one line
        raise RewardFunctionError(f"--reward_fn {spec!r}: cannot import {target}: {type(exc).__name__}: "
                                  f"{_one_line(exc)}") from None


def _import_file(target: str, spec: str):
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise RewardFunctionError(f"--reward_fn {spec!r}: no such file {target}")
    name = f"_reward_fn_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def source_hashes(specs: Sequence[str]) -> dict[str, str]:
    """{file or module named by a spec: a hash of its source}, for the run's record: a resumed run that scores
    with edited functions says so."""
    out = {}
    for spec in specs:
        if spec.partition(":")[0] in BUILTINS:
            continue
        target = spec.rpartition(":")[0]
        if target.endswith(".py"):
            path: Optional[Path] = Path(target).expanduser()
        else:
            try:
                found = importlib.util.find_spec(target)
            except (ImportError, ValueError):
                found = None
            path = Path(found.origin) if found is not None and found.origin else None
        if path is not None and path.is_file():
            out[target] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


def load_reward_functions(specs: Sequence[str], weights: Sequence[float]) -> list[RewardFunction]:
    """The functions `specs` name, imported (each file once), with their weights and unique metric names."""
    modules: dict[str, Any] = {}
    out: list[RewardFunction] = []
    for spec, weight in zip(specs, weights):
        check_spec(spec)
        target, _, name = spec.rpartition(":")
        if spec.partition(":")[0] in BUILTINS:
            function = builtin(spec)
        else:
            if target not in modules:
                modules[target] = _module_of(target, spec)
            fn = getattr(modules[target], name, None)
            if not callable(fn):
                raise RewardFunctionError(f"--reward_fn {spec!r}: {target} has no function {name}")
            function = RewardFunction(name, fn, origin=target)
        taken, unique, k = {f.name for f in out}, function.name, 1
        while unique in taken:  # two functions of one name (length:4,length:8): length, length_2
            k += 1
            unique = f"{function.name}_{k}"
        out.append(RewardFunction(unique, function.fn, weight, function.origin))
    return out


# ---- scoring ---------------------------------------------------------------------------------------

def _one_line(text: Any) -> str:
    return " ".join(str(text).split())[:300]


def _checked(function: RewardFunction, values: Any, count: int, sources: Sequence[str]) -> list[Optional[float]]:
    """`values` as `count` floats or None, or a RewardFunctionError naming the function and the row."""
    who = f"reward function {function.name} ({function.origin})"
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
        if value is not None and not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"{who} returned {type(value).__name__} {_one_line(repr(value))[:60]}, not a "
                                      f"number, for row {source}")
        if value is not None:
            try:
                value = float(value)
            except OverflowError:  # an int past any float
                raise RewardFunctionError(f"{who} returned {_one_line(repr(value))[:40]}..., past float32's range, "
                                          f"for row {source}") from None
            if not math.isfinite(value):
                raise RewardFunctionError(f"{who} returned {value} for row {source}")
            if abs(value) > FLOAT32_MAX or abs(value * function.weight) > FLOAT32_MAX:
                times = "" if abs(value) > FLOAT32_MAX else f" times its weight {function.weight:g}"
                raise RewardFunctionError(f"{who} returned {value:g}{times}, past float32's range, for row {source}")
        out.append(value)
    return out


class _TimedOut(Exception):
    pass


def _run(function: RewardFunction, kwargs: dict[str, list], timeout_s: float) -> Any:
    """The function on its own copies of `kwargs`, in a thread given `timeout_s`: its value, or what it raised
    (SystemExit too), re-raised here; `_TimedOut` when it runs past the limit (the thread is left to itself)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = function.fn(**copy.deepcopy(kwargs))
        except BaseException as exc:  # noqa: BLE001 - carried over to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=target, name=f"reward function {function.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _TimedOut()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _call(function: RewardFunction, kwargs: dict[str, list], sources: Sequence[str], timeout_s: float) -> Any:
    who = f"reward function {function.name} ({function.origin})"
    try:
        return _run(function, kwargs, timeout_s)
    except _TimedOut:
        raise RewardFunctionError(f"{who} ran past --reward_timeout_s {timeout_s:g} on the batch of rows "
                                  f"{sources[0]} ...") from None
    except (Exception, SystemExit) as exc:
        culprit = _failing_row(function, kwargs, sources, timeout_s)
        where = f"row {culprit}" if culprit else f"the batch of rows {sources[0]} ..."
        raise RewardFunctionError(f"{who} raised {type(exc).__name__}: {_one_line(exc)} on {where}") from None


def _failing_row(function: RewardFunction, kwargs: dict[str, list], sources: Sequence[str],
                 timeout_s: float) -> Optional[str]:
    """The first row on which the function raises when called again with that row alone (None: none does)."""
    for i, source in enumerate(sources):
        try:
            _run(function, {key: values[i : i + 1] if isinstance(values, list) else values
                            for key, values in kwargs.items()}, timeout_s)
        except _TimedOut:
            return None
        except (Exception, SystemExit):
            return source
    return None


def _stats(values: list[Optional[float]]) -> tuple[float, float]:
    """(mean, sample std) of the values that apply; NaN mean when none does."""
    present = [v for v in values if v is not None]
    if not present:
        return math.nan, math.nan
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0


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


class Scorer:
    """Scores whole responses: the `adapter`'s head (None: no reward adapter) plus the weighted reward functions."""

    def __init__(self, functions: Sequence[RewardFunction] = (), tokenizer=None, adapter: Optional[str] = REWARD,
                 timeout_s: float = 600.0):
        self.functions, self.tokenizer, self.adapter = list(functions), tokenizer, adapter
        self.timeout_s = timeout_s  # per call of each function
        self.trainer_state: Optional[TrainerState] = None  # set by the training loop before each step
        self._never_applied: set[str] = set()  # functions said (once) to have returned None for a whole batch

    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                 response_mask: torch.Tensor, examples: Optional[Sequence] = None) -> torch.Tensor:
        return self.score(model, input_ids, attention_mask, prompt_length, response_mask, examples)[0]

    def score(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
              response_mask: torch.Tensor, examples: Optional[Sequence] = None,
              adapter_scores: Optional[torch.Tensor] = None,
              nan_unscored: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """((B,) scores, each function's `rewards/NAME/mean` and `/std`, left out where it applied to no row).
        `examples` (one per row, with `source` and `columns`: `trainer.data.tokenization.PromptExample`) give the
        reward functions their columns; `adapter_scores` are the reward adapter's when a fused pass already
        computed them. A row no function scored (every one returned None) and no adapter scores is 0, or NaN
        with `nan_unscored` (GRPO then leaves it out of its group, as TRL does)."""
        total = torch.zeros(input_ids.shape[0], device=input_ids.device)
        if self.adapter is not None:
            if adapter_scores is None:
                adapter_scores = sequence_scores(model, input_ids, attention_mask, response_mask, self.adapter)
            total = adapter_scores.float()
        if not self.functions:
            return total, {}
        metrics = {}
        scored = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=total.device)
        for function, values in zip(self.functions, self.function_values(input_ids, attention_mask, prompt_length,
                                                                          response_mask, examples)):
            if all(v is None for v in values):
                self._say_never_applied(function)
            else:
                metrics[f"rewards/{function.name}/mean"], metrics[f"rewards/{function.name}/std"] = _stats(values)
            scored |= torch.tensor([v is not None for v in values], device=total.device)
            added = torch.tensor([0.0 if v is None else v for v in values], device=total.device)
            total = total + function.weight * added
        if not torch.isfinite(total).all():
            row = int((~torch.isfinite(total)).nonzero()[0, 0])
            where = examples[row].source if examples is not None else f"batch row {row}"
            raise RewardFunctionError(f"the weighted rewards of row {where} sum past float32's range "
                                      f"({', '.join(f.name for f in self.functions)}): scale them down")
        if nan_unscored and self.adapter is None:
            total = torch.where(scored, total, math.nan)
        return total, metrics

    def _say_never_applied(self, function: RewardFunction) -> None:
        if function.name not in self._never_applied:
            self._never_applied.add(function.name)
            logger.warning("reward function %s (%s) returned None for every row of a batch: it scored nothing "
                           "there (said once)", function.name, function.origin)

    def function_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                        response_mask: torch.Tensor, examples: Optional[Sequence] = None
                        ) -> list[list[Optional[float]]]:
        """Each reward function's checked values, one per row (None: does not apply), unweighted, in order."""
        kwargs, sources = self._arguments(input_ids, attention_mask, prompt_length, response_mask, examples)
        return [_checked(f, _call(f, kwargs, sources, self.timeout_s), len(sources), sources)
                for f in self.functions]

    def _arguments(self, input_ids, attention_mask, prompt_length, response_mask, examples
                   ) -> tuple[dict[str, list], list[str]]:
        """The functions' keyword arguments (TRL's) and each row's source."""
        tok, rows = self.tokenizer, input_ids.shape[0]
        responses, keep = input_ids[:, prompt_length:], response_mask.bool()
        completion_ids = [row[mask].tolist() for row, mask in zip(responses, keep)]
        texts = tok.batch_decode(responses.masked_fill(~keep, tok.pad_token_id), skip_special_tokens=True)
        if examples is not None and len(examples) != rows:
            raise ValueError(f"{len(examples)} examples for {rows} rows")
        if examples is None or any("prompt" not in e.columns for e in examples):  # the prompt text, then
            prompt_mask = attention_mask[:, :prompt_length] == 0
            decoded = tok.batch_decode(input_ids[:, :prompt_length].masked_fill(prompt_mask, tok.pad_token_id),
                                       skip_special_tokens=True)
        # TRL's functions may name `trainer_state`
        state = {} if self.trainer_state is None else {"trainer_state": self.trainer_state}
        if examples is None:  # no dataset row at hand: no column besides the prompt
            return ({"prompts": decoded, "completions": texts, "completion_ids": completion_ids, **state},
                    [f"batch row {i}" for i in range(rows)])
        prompts = [e.columns["prompt"] if "prompt" in e.columns else decoded[i] for i, e in enumerate(examples)]
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        names = sorted({k for e in examples for k in e.columns} - {"prompt", "trainer_state", *RESERVED})
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  **{k: [e.columns.get(k) for e in examples] for k in names}, **state}
        return kwargs, [e.source for e in examples]


def describe(functions: Sequence[RewardFunction]) -> str:
    """One log line: which functions score, with their weights, and which files were imported."""
    files = sorted({f.origin for f in functions if f.origin != "built-in"})
    listed = ", ".join(f"{f.name} (weight {f.weight:g})" for f in functions)
    return f"reward functions: {listed}; imported from: {', '.join(files) or 'nothing (built-ins only)'}"
