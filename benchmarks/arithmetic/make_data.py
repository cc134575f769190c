"""Word problems with one exact integer answer: a task RL can be checked on, made here (no download).

    python -m benchmarks.arithmetic.make_data --out data/arithmetic [--train 2000 --heldout 300 --seed 0]
                                              [--level two_digit|one_digit]

Writes train.jsonl and heldout.jsonl, one row per problem: `{"prompt": [{"role": "user", "content": ...}],
"answer": "71"}` (a conversational prompt, the answer as a separate column for the reward functions).
Each problem (level two_digit) is one or two steps of adding, taking away or multiplying small whole numbers;
level one_digit only adds or takes away numbers under 10. Every prompt shows one worked example and asks for
the result on a last line `Answer: N`. Held-out problems never repeat a training problem.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Optional

from foundation.cli import argument_parser, run
from foundation.files import atomic_folder

ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun")
# One worked example, of names and items the problems never use: the format to keep, shown once.
INSTRUCTION = ("Solve the problem. Work it out in one line, then end with a last line 'Answer: N', N a whole number. "
               "For example:\nProblem: Lea has 7 pens and gives away 3. How many pens are left?\n"
               "Lea has 7 - 3 = 4 pens left.\nAnswer: 4")
LEVELS = ("two_digit", "one_digit")


def one_digit_problem(rng: random.Random) -> tuple[str, int]:
    """(the question, its answer): one step, adding or taking away numbers under 10."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        return f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?", a + b
    return f"{name} has {a + b} {item} and gives away {b}. How many {item} are left?", a


def problem(rng: random.Random, level: str = "two_digit") -> tuple[str, int]:
    """(the question, its answer)."""
    if level == "one_digit":
        return one_digit_problem(rng)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(("add", "take", "times", "add_take"))
    a, b = rng.randint(12, 89), rng.randint(11, 49)
    if kind == "add":
        return f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "take":
        a = a + b
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    if kind == "times":
        n, k = rng.randint(3, 9), rng.randint(4, 12)
        return f"{name} fills {n} boxes with {k} {item} each. How many {item} is that in all?", n * k
    c = rng.randint(5, min(a + b - 1, 40))
    return (f"{name} has {a} {item}, finds {b} more, then loses {c}. How many {item} does {name} have now?",
            a + b - c)


def rows(count: int, rng: random.Random, taken: set[str], level: str = "two_digit") -> list[dict]:
    out = []
    while len(out) < count:
        question, answer = problem(rng, level)
        if question in taken:
            continue
        taken.add(question)
        out.append({"prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\nProblem: {question}"}],
                    "answer": str(answer)})
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, int]:
    parser = argument_parser("python -m benchmarks.arithmetic.make_data", __doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for train.jsonl and heldout.jsonl.")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--level", choices=LEVELS, default="two_digit",
                        help="two_digit: one or two steps with +, - and x; one_digit: one step, + or - under 10.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rng, taken = random.Random(args.seed), set()
    heldout = rows(args.heldout, rng, taken, args.level)  # first: the held-out set does not move with --train
    train = rows(args.train, rng, taken, args.level)
    with atomic_folder(args.out) as folder:
        for name, part in (("train", train), ("heldout", heldout)):
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"wrote {len(train)} training and {len(heldout)} held-out problems into {args.out}")
    return {"train": len(train), "heldout": len(heldout)}


if __name__ == "__main__":
    run(main)
