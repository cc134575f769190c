"""How reward functions are named on the command line: `--reward_fn` specs (a built-in `keyword:WORD`,
`length:N`, `chars:N`; `PATH.py:NAME`; `package.module:NAME`), comma-separated, and their `--reward_weights`.
Read here without importing anything; `trainer.rl.rewards` makes the functions.
"""

from __future__ import annotations

import math
from typing import Optional

from foundation.cli import UsageError

BUILTINS = ("keyword", "length", "chars")  # the built-in reward functions (trainer/rl/rewards.py)


def check_builtin(spec: str, flag: str = "--reward_fn") -> tuple[str, str]:
    """(kind, argument) of a built-in reward spec - `keyword:WORD`, `length:N` or `chars:N` - or a UsageError in
    one line (`trainer.rl.rewards.builtin` makes the function)."""
    kind, _, arg = spec.partition(":")
    if kind not in BUILTINS or not arg:
        raise UsageError(f"{flag} {spec!r}: use keyword:WORD, length:N or chars:N")
    if kind != "keyword" and (not arg.isdigit() or int(arg) < 1):
        raise UsageError(f"{flag} {spec!r}: N must be a whole number of at least 1")
    return kind, arg


def split_specs(text: Optional[str]) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def check_spec(spec: str) -> None:
    """A UsageError unless `spec` reads as a built-in, `PATH.py:NAME` or `package.module:NAME` (not imported)."""
    if spec.partition(":")[0] in BUILTINS:  # a built-in wins over a module of its name (the standard `keyword`)
        check_builtin(spec)
        return
    target, sep, name = spec.rpartition(":")
    dotted = all(part.isidentifier() for part in target.split("."))
    if not sep or not name.isidentifier() or not (target.endswith(".py") or dotted):
        raise UsageError(f"--reward_fn {spec!r}: use PATH.py:NAME, package.module:NAME, keyword:WORD, length:N or "
                         "chars:N (several: comma-separated)")


def parse_weights(text: Optional[str], count: int) -> list[float]:
    """The --reward_weights of `count` functions (1 each when unset)."""
    if not text:
        return [1.0] * count
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--reward_weights {text!r}: use comma-separated numbers, one per --reward_fn") from None
    if len(weights) != count:
        raise UsageError(f"--reward_weights {text!r}: {len(weights)} weights for {count} reward functions")
    if not all(math.isfinite(w) for w in weights):
        raise UsageError(f"--reward_weights {text!r}: every weight must be a finite number")
    return weights
