"""The margin of the PPO and GRPO learning checks (tests/test_ppo_learning.py, tests/test_grpo_learning.py)
over seeds and thread counts, and with the update's sign flipped (which must fail the check).

Each run is the test's own command (`trainer/STAGE.py --config tests/configs/smol_STAGE_chars.yaml`) in a
process of its own. A flipped run negates the advantages inside that process only (a patch of the
stage's advantage function applied before `main`), so the trainer has no switch for it.

    python -m benchmarks.learning_margin --stages ppo grpo --seeds 0 1 2 --threads 1 2 --flipped_seeds 0 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from foundation.files import write_atomic
from foundation.provenance import PROJECT_ROOT, provenance
from profiling.report import table_lines

CONFIGS = {"ppo": "tests/configs/smol_ppo_chars.yaml", "grpo": "tests/configs/smol_grpo_chars.yaml"}
# The advantage function each stage's step calls, and how to negate its output.
FLIPS = {
    "ppo": "import dataclasses, trainer.rl.algorithms.ppo as m; f = m.compute_advantages; "
           "m.compute_advantages = lambda *a: (lambda adv: dataclasses.replace(adv, advantages=-adv.advantages))(f(*a))",
    "grpo": "import trainer.rl.algorithms.grpo as m; f = m.group_advantages; "
            "m.group_advantages = lambda *a, **k: -f(*a, **k)",
}
RUNNER = "import sys, runpy; {flip}; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def run_one(stage: str, seed: int, threads: int, flipped: bool, out: Path) -> dict:
    """One learning run; its held-out evaluation before and after training, and its wall time."""
    command = [sys.executable, "-c", RUNNER.format(flip=FLIPS[stage] if flipped else "pass"), f"trainer/{stage}.py",
               "--config", CONFIGS[stage], "--output_dir", str(out), "--seed", str(seed)]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=PROJECT_ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                          capture_output=True, text=True)
    record = {"stage": stage, "seed": seed, "threads": threads, "flipped": flipped,
              "wall_s": round(time.perf_counter() - start, 1), "exit_code": proc.returncode}
    if proc.returncode != 0:
        return {**record, "error": proc.stderr.strip().splitlines()[-1:]}
    results = json.loads((out / "results.json").read_text())
    before, after = results["eval_before"], results["eval_after"]
    return {**record, "score_before": before["eval/score_policy"], "score_policy": after["eval/score_policy"],
            "score_sft": after["eval/score_sft"], "gain": after["eval/score_policy"] - after["eval/score_sft"],
            "win_rate": after["eval/win_rate"], "kl": after["eval/kl"]}


def table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        run = [r["stage"], r["seed"], r["threads"], "flipped" if r["flipped"] else "as is"]
        cells.append([*run, f"failed: {r['error']}", *[None] * 5] if r["exit_code"] else [
            *run, f"{r['score_sft']:.3f}", f"{r['score_policy']:.3f}", f"{r['gain']:+.3f}", f"{r['win_rate']:.3f}",
            f"{r['kl']:.2f}", f"{r['wall_s']:.0f}"])
    return "\n".join(table_lines(["stage", "seed", "threads", "update", "score SFT", "score policy", "gain", "win rate",
                                  "KL", "s"], "l" * 10, cells))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", choices=sorted(CONFIGS), default=["ppo", "grpo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--flipped_seeds", nargs="*", type=int, default=[0], help="Seeds also run with the sign flipped (one thread).")
    parser.add_argument("--jobs", type=int, default=1, help="Runs at a time (each in its own process).")
    parser.add_argument("--out_dir", default="benchmarks/results/learning_margin-smollm2-135m-cpu")
    args = parser.parse_args(argv)
    runs = [(stage, seed, threads, False) for stage in args.stages for seed in args.seeds for threads in args.threads]
    runs += [(stage, seed, 1, True) for stage in args.stages for seed in args.flipped_seeds]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, *run, Path(tmp) / str(i)) for i, run in enumerate(runs)]
        for future in as_completed(futures):
            print(table([future.result()]).splitlines()[-1], flush=True)
        rows = [future.result() for future in futures]
    out = Path(args.out_dir)
    write_atomic(out / "result.json", json.dumps({"provenance": provenance(), "runs": rows}, indent=2))
    write_atomic(out / "README.md", f"# Learning checks: margin over seeds and threads\n\n`{provenance()['command']}`\n\n"
                 f"{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
