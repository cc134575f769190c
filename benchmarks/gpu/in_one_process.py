"""Several stage runs one after another in ONE Python process, as the pipeline runs them.

    python -m benchmarks.gpu.in_one_process sft ARGS... :: reward ARGS...

On the GPU machine every process pays the imports and CUDA's start before it builds its 7B model: the
stages whose own figures the kit does not report (the one-step SFT and reward runs that only make the
adapters PPO starts from) share one process. A stage that fails stops the chain (the next one needs
its adapter) with that stage's exit status.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from foundation.cli import UsageError, run

SEPARATOR = "::"


def split_runs(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(stage, its arguments)] from `STAGE ARGS :: STAGE ARGS ...`."""
    runs, current = [], []
    for arg in [*argv, SEPARATOR]:
        if arg != SEPARATOR:
            current.append(arg)
            continue
        if not current:
            raise UsageError(f"an empty run between '{SEPARATOR}' separators")
        runs.append((current[0], current[1:]))
        current = []
    return runs


def main(argv: Optional[list[str]] = None) -> list[dict]:
    from trainer.config import PIPELINE_STAGES
    from trainer.pipeline import run_stage

    runs = split_runs(list(sys.argv[1:] if argv is None else argv))
    unknown = [stage for stage, _ in runs if stage not in PIPELINE_STAGES]
    if unknown:
        raise UsageError(f"unknown stage {unknown[0]!r}: use some of {', '.join(PIPELINE_STAGES)}")
    results = []
    for stage, args in runs:
        if "--output_dir" not in args:
            raise UsageError(f"stage {stage}: give its --output_dir")
        out = Path(args[args.index("--output_dir") + 1])
        module, _, fixed = PIPELINE_STAGES[stage]
        args = [*args, *(a for key, value in fixed.items() for a in (f"--{key}", value))]
        print(f"[{stage}] {' '.join(args)}", flush=True)
        results.append(run_stage(stage, args, out, module))
    return results


if __name__ == "__main__":
    run(main)
