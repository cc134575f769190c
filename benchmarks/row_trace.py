"""Which rows each training step read, recorded from outside the trainer: the probe behind the row-order tests
(resume, several ranks) and behind `benchmarks.stages_vs_trl` (both sides train on the same rows).

    python -m benchmarks.row_trace FOLDER trainer/sft.py --config ...      # a stage script, traced
    accelerate launch ... benchmarks/row_trace.py FOLDER trainer/sft.py --config ...

While `traced(FOLDER)` is on, each rank appends per micro-batch a short hash of every row it trains on to
FOLDER/rows-rank{R}.jsonl, one line `{"step": S, "rows": [...]}`.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch


def row_hash(ids) -> str:
    """The short hash of one row: its unpadded token ids as int64 (a tensor or a list)."""
    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.long).cpu().numpy().tobytes()).hexdigest()[:16]


def _recorded(path: Path, step: int, batches: Iterator[dict]) -> Iterator[dict]:
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        rows = [row_hash(ids[i][mask[i]]) for i in range(ids.shape[0])]
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "rows": rows}) + "\n")
        yield batch


@contextmanager
def traced(folder: str | Path) -> Iterator[Path]:
    """Record the rows of every micro-batch a `Harness` trains on into `folder` while the block runs."""
    from trainer.engine.harness import Harness

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train = Harness.train

    def traced_train(self, step_body):
        path = folder / f"rows-rank{self.accelerator.process_index}.jsonl"
        return train(self, lambda step, batches: step_body(step, _recorded(path, step, batches)))

    Harness.train = traced_train
    try:
        yield folder
    finally:
        Harness.train = train


if __name__ == "__main__":
    folder, script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    with traced(folder):
        runpy.run_path(script, run_name="__main__")
