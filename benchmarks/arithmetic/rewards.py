"""Reward functions of the arithmetic task, in TRL's convention: keyword arguments `prompts`,
`completions` and the row's other columns (`answer`), one float per completion.

    --reward_fn benchmarks/arithmetic/rewards.py:correct,benchmarks/arithmetic/rewards.py:formatted
"""

from __future__ import annotations

import re
from typing import Optional

ANSWER = re.compile(r"Answer:\s*(-?\d+)\s*$")


def _text(completion) -> str:
    """A completion as text: plain text, or the content of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion)


def parse_answer(completion) -> Optional[str]:
    """The N of a last line `Answer: N`, or None when the completion does not end that way."""
    found = ANSWER.search(_text(completion).strip())
    return found.group(1) if found else None


def correct(completions, answer, **_) -> list[float]:
    """1 when the last line gives the right number, else 0."""
    return [float(parse_answer(c) == a) for c, a in zip(completions, answer)]


def formatted(completions, **_) -> list[float]:
    """1 when the completion ends with a line `Answer: N`, else 0 (right or wrong)."""
    return [float(parse_answer(c) is not None) for c in completions]
