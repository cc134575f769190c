"""The score of a response: the reward adapter's (weight 1) plus each reward function's value times its weight.

A reward function follows TRL's convention: it takes keyword arguments `prompts`, `completions` (decoded
text; for a conversational row `[{"role": "assistant", "content": text}]`), `completion_ids` and every other
column of the rows (e.g. `answer`), each a list with one entry per completion, and returns one float per
completion, or None where it does not apply (left out of its mean, 0 in the sum). Functions come only from
the settings (`--reward_fn PATH.py:NAME` or `package.module:NAME`); the toy rewards `keyword:WORD`,
`length:N` and `chars:N` are built-in functions of the same kind. User functions run in a worker process
(`trainer.rl.reward_worker`): one that fails, exits, runs past `--reward_timeout_s` or returns what is not a
finite reward (within +-1e15 after its weight) stops the run with one line naming it and the row
(`RewardFunctionError`). Each function gets its own copies of the rows: what one changes in place reaches
neither the next function nor the dataset.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import importlib.util
import logging
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from foundation.reward_specs import BUILTINS, check_builtin, check_spec
from foundation.stages import REWARD
from trainer.rl.reward_worker import (
    LOAD_TIMEOUT_S, REWARD_LIMIT, RewardFunctionError, RewardWorker, TrainerState, checked_values,
)
from trainer.rl.scoring import sequence_scores

logger = logging.getLogger(__name__)

RESERVED = ("prompts", "completions", "completion_ids")  # the call's own arguments: a column cannot replace them


@dataclass(frozen=True)
class RewardFunction:
    name: str  # its name in the metrics: rewards/NAME/mean
    fn: Optional[Callable[..., Any]]  # a built-in's function; None for user code, which runs in `worker`
    weight: float = 1.0
    origin: str = "built-in"  # the file or module it was imported from
    spec: str = ""  # as --reward_fn named it
    worker: Optional[RewardWorker] = None

    @property
    def who(self) -> str:
        return f"reward function {self.name} ({self.origin})"


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
    """The functions `specs` name, with their weights and unique metric names. User code is imported in one
    `RewardWorker` process (each file once); a failure there is one line."""
    worker: Optional[RewardWorker] = None
    out: list[RewardFunction] = []
    for spec, weight in zip(specs, weights):
        check_spec(spec)
        target, _, name = spec.rpartition(":")
        if spec.partition(":")[0] in BUILTINS:
            function = builtin(spec)
        else:
            worker = worker or _start_worker()
            _loaded(worker, worker.load(spec, target, name), spec, target)
            function = RewardFunction(name, None, origin=target, spec=spec, worker=worker)
        taken, unique, k = {f.name for f in out}, function.name, 1
        while unique in taken:  # two functions of one name (length:4,length:8): length, length_2
            k += 1
            unique = f"{function.name}_{k}"
        out.append(replace(function, name=unique, weight=weight))
    return out


def _start_worker() -> RewardWorker:
    """A new worker process, ended when its functions are closed (`close_workers`) or at exit at the latest."""
    worker = RewardWorker()
    atexit.register(worker.close)
    return worker


def _end(worker: RewardWorker, kill: bool = False) -> None:
    atexit.unregister(worker.close)
    worker.close(kill=kill)


def close_workers(functions: Sequence[RewardFunction]) -> None:
    """End the workers of `functions`."""
    for worker in {id(f.worker): f.worker for f in functions if f.worker is not None}.values():
        _end(worker)


def _loaded(worker: RewardWorker, reply: tuple, spec: str, target: str) -> None:
    if reply[0] == "ok":
        return
    _end(worker, kill=True)
    what = {"error": lambda: reply[1],
            "gone": lambda: f"cannot import {target}: its process ended (exit code {reply[1]}) while importing it",
            "late": lambda: f"cannot import {target}: importing it ran past {LOAD_TIMEOUT_S:g} s"}
    raise RewardFunctionError(f"--reward_fn {spec!r}: {what[reply[0]]()}")


# ---- scoring ---------------------------------------------------------------------------------------

def _values(function: RewardFunction, kwargs: dict[str, list], sources: Sequence[str],
            timeout_s: float) -> list[Optional[float]]:
    """The function's checked values on `kwargs` (one per source): a built-in here on its own copies, user code
    in its worker; whatever goes wrong is a RewardFunctionError naming the function and the row."""
    who = function.who
    if function.worker is None:
        return checked_values(who, function.weight, function.fn(**copy.deepcopy(kwargs)), sources)
    reply = function.worker.call(function.spec, who, function.weight, kwargs, sources, timeout_s)
    batch = f"the batch of rows {sources[0]} ..."
    if reply[0] == "values":
        return reply[1]
    if reply[0] == "bad":
        raise RewardFunctionError(reply[1])
    if reply[0] == "raised":
        _, kind, text, row = reply
        raised = f"{kind}: {text}" if text else kind
        raise RewardFunctionError(f"{who} raised {raised} on {f'row {row}' if row else batch}")
    if reply[0] == "late":
        raise RewardFunctionError(f"{who} ran past --reward_timeout_s {timeout_s:g} on {batch}")
    raise RewardFunctionError(f"{who} ended its process (exit code {reply[1]}) on {batch}")


def _stats(values: list[Optional[float]]) -> tuple[float, float]:
    """(mean, sample std) of the values that apply; NaN mean when none does."""
    present = [v for v in values if v is not None]
    if not present:
        return math.nan, math.nan
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0


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
        if not (total.abs() <= REWARD_LIMIT).all():  # NaN fails too
            row = int((~(total.abs() <= REWARD_LIMIT)).nonzero()[0, 0])
            where = examples[row].source if examples is not None else f"batch row {row}"
            raise RewardFunctionError(f"the weighted rewards of row {where} sum past +-{REWARD_LIMIT:g} "
                                      f"({', '.join(f.name for f in self.functions)}): scale them down")
        if nan_unscored and self.adapter is None:
            total = torch.where(scored, total, math.nan)
        return total, metrics

    def close(self) -> None:
        """End the worker process of its reward functions (a later call would fail: use it when done)."""
        close_workers(self.functions)

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
        return [_values(f, kwargs, sources, self.timeout_s) for f in self.functions]

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
