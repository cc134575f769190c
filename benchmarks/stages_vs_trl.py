"""Our SFT, reward and DPO stages against TRL's SFTTrainer, RewardTrainer and DPOTrainer on the same work.

    python -m benchmarks.stages_vs_trl --stage reward                 # SmolLM2-135M, CPU or GPU

One stage per run, each side in its own process, with the same weights, LoRA shape, rows in the same order,
batch sizes, optimizer and schedule objects and loss; both adapters are then scored by `trainer.evaluate` on
the same held-out split (docs/performance.md, "Method"). Writes stages_vs_trl.json and .md into `--out_dir`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.measure import log_to_stdout
from benchmarks.row_trace import row_hash  # what the row trace of our side writes
from foundation.cli import Checked, UsageError, at_least, one_of, parse, run, unplanned
from foundation.provenance import library_versions
from foundation.settings import DataArguments, ModelArguments, TrainArguments

logger = logging.getLogger("benchmarks.stages_vs_trl")
ROOT = Path(__file__).resolve().parent.parent
STAGES = ("sft", "reward", "dpo")
# Ablations of ours: the TrainArguments each changes, so each gain is attributed.
ABLATIONS = {"ours_ungrouped": {"group_by_length": False}, "ours_unshared": {"share_pair_prompts": False}}
SIDES = ("ours", "trl", *ABLATIONS)
SIDE_NAMES = {"sft": {"ours": "ours (trainer/sft.py)", "trl": "TRL 1.12 SFTTrainer"},
              "reward": {"ours": "ours (trainer/reward.py)", "trl": "TRL 1.12 RewardTrainer"},
              "dpo": {"ours": "ours (trainer/dpo.py)", "trl": "TRL 1.12 DPOTrainer"}}
ABLATION_NAMES = {"ours_ungrouped": "ours, ablation: micro-batches in shuffle order (--group_by_length false)",
                  "ours_unshared": "ours, ablation: chosen and rejected as rows of their own (--share_pair_prompts "
                                   "false)"}

# Where the benchmark's settings differ from the trainer's defaults: 150 steps of 16 rows, no gradient
# checkpointing (as the CPU configs; pass --gradient_checkpointing true on a GPU: both sides get it), a fresh LoRA
# (no SFT adapter: both sides start from the base, which is also DPO's reference), at least 500 held-out
# pairs, no checkpoints, trackers or mid-run evaluation (our stage's own start / end evaluation reads one
# batch; the figures that count come from trainer.evaluate afterwards, the same code for both sides).
BENCH_DEFAULTS = {"max_steps": 150, "micro_batch_size": 8, "gradient_accumulation_steps": 2, "max_length": 128,
                  "eval_size": 700, "ppo_size": 0, "warmup_steps": 10, "min_lr_ratio": 0.1, "weight_decay": 0.0,
                  "lora_dropout": 0.0, "gradient_checkpointing": False, "report_to": "none", "progress_bar": False, "save_every": 0, "eval_every": 0,
                  "eval_batches": 1, "eval_batch_size": 16, "check_budget": False, "resume": "no"}
STAGE_DEFAULTS = {"sft": {"learning_rate": 2e-4, "sft_size": 1_000_000, "reward_size": 0},
                  "reward": {"learning_rate": 2e-4, "sft_size": 0, "reward_size": 1_000_000},
                  "dpo": {"learning_rate": 5e-4, "sft_size": 0, "reward_size": 1_000_000}}


@dataclass
class StagesBenchArguments(Checked):
    """What the benchmark adds to the training settings."""

    stage: str = field(default="reward", metadata={"help": "sft, reward or dpo."})
    beta: float = field(default=0.1, metadata={"help": "dpo: the temperature of sigmoid DPO, on both sides."})
    sides: str = field(default="ours,trl", metadata={
        "help": "Which sides to run, in this order: ours, trl, and the ablations of ours: ours_ungrouped "
                "(--group_by_length false), ours_unshared (--share_pair_prompts false)."})
    warmup_runs: int = field(default=1, metadata={"help": "First optimizer steps left out of the timings."})
    evaluate: bool = field(default=True, metadata={
        "help": "Score both adapters on the held-out split (false: speed and memory only, e.g. random-weight presets)."})
    out_dir: Optional[str] = field(default=None, metadata={
        "help": "Default benchmarks/results/stages_vs_trl-STAGE-MODEL-DEVICE."})

    RULES = {"stage": one_of(*STAGES), "warmup_runs": at_least(0)}


@dataclass(frozen=True)
class StageWorkload:
    """One stage's work, run by our trainer and by TRL's trainer: the trainer's own settings objects."""

    model: ModelArguments
    data: DataArguments
    train: TrainArguments
    bench: StagesBenchArguments

    @classmethod
    def parse(cls, argv: Sequence[str]) -> "StageWorkload":
        stage = _flag(argv, "stage", "reward")
        if stage not in STAGES:
            raise UsageError(f"--stage {stage!r}: must be one of {', '.join(STAGES)}")
        model, data, train, bench = parse([ModelArguments, DataArguments, TrainArguments, StagesBenchArguments], argv,
                                          {**BENCH_DEFAULTS, **STAGE_DEFAULTS[stage]})
        return cls(unplanned(model), data, unplanned(train), bench)  # the work is set, the same for both sides

    @classmethod
    def from_dict(cls, values: dict) -> "StageWorkload":
        # a stored result's bench settings may name a flag removed since (--rescore reads old results)
        bench = {k: v for k, v in values["bench"].items() if k in StagesBenchArguments.__dataclass_fields__}
        return cls(ModelArguments(**values["model"]), DataArguments(**values["data"]),
                   TrainArguments(**values["train"]), StagesBenchArguments(**bench))

    def to_dict(self) -> dict[str, dict]:
        return {part: asdict(getattr(self, part)) for part in ("model", "data", "train", "bench")}

    @property
    def stage(self) -> str:
        return self.bench.stage

    @property
    def rows_per_step(self) -> int:
        return self.train.micro_batch_size * self.train.gradient_accumulation_steps

    @property
    def side_list(self) -> list[str]:
        sides = [s.strip() for s in self.bench.sides.split(",") if s.strip()]
        if not sides or set(sides) - set(SIDES):
            raise UsageError(f"--sides {self.bench.sides!r}: use some of {', '.join(SIDES)}")
        return sides

    def check(self) -> None:
        self.side_list  # noqa: B018  (raises on an unknown side before anything is loaded)
        if self.bench.warmup_runs >= self.train.max_steps:
            raise UsageError(f"--warmup_runs {self.bench.warmup_runs} leaves no measured step of --max_steps "
                             f"{self.train.max_steps}")

    def stage_flags(self) -> list[str]:
        """The `stage:` settings our stage script gets (the benchmark's are fixed: a fresh LoRA, sigmoid DPO)."""
        return ["--beta", str(self.bench.beta), "--loss_type", "sigmoid"] if self.stage == "dpo" else []


def _flag(argv: Sequence[str], name: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return default


# ---- the rows both sides train on ----------------------------------------------------------------------
def training_rows(w: StageWorkload, tokenizer) -> list:
    """The examples of every optimizer step, in the order our harness draws them: the stage's split of
    the data tokenized by `trainer.data`, in epoch 0 of `EpochShuffleSampler(seed)`, cut to
    max_steps x micro-batch x accumulation rows (one epoch at most: the two sides reshuffle differently)."""
    from trainer.data.formats import parser_for
    from trainer.data.hh_rlhf import load_splits
    from trainer.data.tokenization import tokenize_pairs, tokenize_sft
    from trainer.engine.batches import EpochShuffleSampler

    splits, _ = load_splits(w.data, parser_for(w.data, tokenizer))
    if w.stage == "sft":
        examples, _ = tokenize_sft(splits.sft, tokenizer, w.data)
    else:
        examples, _ = tokenize_pairs(splits.reward, tokenizer, w.data)
    needed = w.train.max_steps * w.rows_per_step
    if needed > len(examples):
        raise UsageError(f"{w.train.max_steps} steps of {w.rows_per_step} rows need {needed} rows, and the {w.stage} "
                         f"split has {len(examples)}: fewer --max_steps, a smaller batch or a larger --max_length")
    order = list(EpochShuffleSampler(len(examples), w.train.seed))
    return [examples[i] for i in order[:needed]]


def row_texts(example, shared_prompt: bool = False) -> list[list[int]]:
    """The token rows one example puts into a training batch: prompt + completion (SFT), or prompt +
    chosen and prompt + rejected (pairs), or with `shared_prompt` the pair's one row prompt + chosen +
    rejected (SharedPromptPairCollator)."""
    if hasattr(example, "completion_ids"):
        return [example.prompt_ids + example.completion_ids]
    if shared_prompt:
        return [example.prompt_ids + example.chosen_ids + example.rejected_ids]
    return [example.prompt_ids + example.chosen_ids, example.prompt_ids + example.rejected_ids]


def step_rows(w: StageWorkload, trace: Sequence[Sequence[str]]) -> list[list[str]]:
    """Row hashes per optimizer step, sorted: what a step trains on, whatever micro-batches it forms."""
    accum = w.train.gradient_accumulation_steps
    return [sorted(h for batch in trace[i : i + accum] for h in batch) for i in range(0, len(trace), accum)]


def expected_trace(w: StageWorkload, rows: Sequence, shared_prompt: bool = False) -> list[list[str]]:
    """Row hashes per micro-batch of the plain shuffle (our length grouping reorders rows inside a step, never
    across steps), as a batch lays them out: prompt + completion rows, or for pairs with `shared_prompt`
    one row of prompt + chosen + rejected (SharedPromptPairCollator)."""
    micro = w.train.micro_batch_size
    return [[row_hash(t) for e in rows[start : start + micro] for t in row_texts(e, shared_prompt)]
            for start in range(0, len(rows), micro)]


def step_tokens(w: StageWorkload, rows: Sequence) -> list[int]:
    """Real (unpadded) tokens each optimizer step trains on: the same rows, so the same count on both sides."""
    per = w.rows_per_step
    return [sum(len(t) for e in rows[i : i + per] for t in row_texts(e)) for i in range(0, len(rows), per)]


def computed_tokens(w: StageWorkload, rows: Sequence, trace: Sequence[Sequence[str]]) -> list[int]:
    """Tokens each optimizer step of a side computed: every micro-batch's rows times its longest row (padding
    included), from the rows its trace recorded, in either pair layout."""
    length = {row_hash(t): len(t) for e in rows for shared in (False, True) for t in row_texts(e, shared)}
    batches = [len(batch) * max(length[h] for h in batch) for batch in trace]
    accum = w.train.gradient_accumulation_steps
    return [sum(batches[i : i + accum]) for i in range(0, len(batches), accum)]


# ---- one side, in a process of its own -------------------------------------------------------------------
def run_side(name: str, w: StageWorkload, out_dir: Path) -> dict:
    """`python -m benchmarks.stage_side NAME` in a fresh process; its side.json (or the error it died with)."""
    side_dir = (out_dir / name).resolve()
    shutil.rmtree(side_dir, ignore_errors=True)
    side_dir.mkdir(parents=True)
    (side_dir / "settings.json").write_text(json.dumps(w.to_dict(), indent=2))
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    # Inside the project the side is named relative to its root (its cwd), so the paths it records are too.
    where = side_dir.relative_to(ROOT) if side_dir.is_relative_to(ROOT) else side_dir
    command = [sys.executable, "-m", "benchmarks.stage_side", name, str(where / "settings.json"), str(where)]
    logger.info("%s side: %s", name, " ".join(shlex.quote(c) for c in command))
    proc = subprocess.run(command, cwd=ROOT, env=env)
    path = side_dir / "side.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"side": name, "status": "failed", "error": f"the side's process exited with {proc.returncode} and wrote "
            "no side.json (its log is above)"}


def evaluate_side(w: StageWorkload, side: dict) -> dict:
    """The side's saved adapter scored by trainer.evaluate on the held-out split: the same code for both."""
    from trainer.evaluate import EvalArguments, evaluate

    args = EvalArguments(adapter=str(ROOT / side["adapter"]), split="eval", batch_size=w.train.eval_batch_size,
                         progress_bar=sys.stderr.isatty())
    result = evaluate(w.stage, args)
    return {k: v for k, v in result.items() if k not in ("adapter", "data")}


# ---- figures -----------------------------------------------------------------------------------------
def summarize(side: dict, tokens: list[int], warmup: int) -> dict[str, Any]:
    """Means over the measured steps (the first `warmup` left out); tokens/s over the same steps; the tokens
    computed per step (padding included) over every step, where the side's trace gave them."""
    steps = [s for s in side.get("steps", []) if s["step"] > warmup]
    if not steps:
        return {}
    wall = [s["wall_s"] for s in steps]
    cpu = [s["cpu_s"] for s in steps if s.get("cpu_s") is not None]
    measured_tokens = sum(tokens[s["step"] - 1] for s in steps)
    computed = side.get("computed_tokens_per_step")
    out = {"measured_steps": len(steps), "step_s": statistics.fmean(wall), "step_s_median": statistics.median(wall),
           "step_cpu_s": statistics.fmean(cpu) if cpu else None,
           "tokens_per_s": measured_tokens / sum(wall),
           "tokens_per_cpu_s": measured_tokens / sum(cpu) if cpu else None,
           "computed_tokens_per_step": statistics.fmean(computed) if computed else None,
           "computed_over_real_tokens": sum(computed) / sum(tokens[: len(computed)]) if computed else None}
    for key in ("peak_rss_bytes", "peak_rss_above_start_bytes", "peak_allocated_bytes", "peak_reserved_bytes"):
        out[key] = side.get(key)
    return out


def ratios(ours: dict, trl: dict) -> dict[str, Optional[float]]:
    """TRL's figure over ours for times and memory, ours over TRL's for tokens/s: > 1 means ours is better."""
    def over(a, b):
        return a / b if a and b else None

    return {"step_time_speedup": over(trl.get("step_s"), ours.get("step_s")),
            "computed_tokens_trl_over_ours": over(trl.get("computed_tokens_per_step"),
                                                  ours.get("computed_tokens_per_step")),
            "step_cpu_time_speedup": over(trl.get("step_cpu_s"), ours.get("step_cpu_s")),
            "tokens_per_s_ratio": over(ours.get("tokens_per_s"), trl.get("tokens_per_s")),
            "peak_rss_trl_over_ours": over(trl.get("peak_rss_bytes"), ours.get("peak_rss_bytes")),
            "peak_rss_above_start_trl_over_ours": over(trl.get("peak_rss_above_start_bytes"),
                                                       ours.get("peak_rss_above_start_bytes")),
            "peak_allocated_trl_over_ours": over(trl.get("peak_allocated_bytes"), ours.get("peak_allocated_bytes"))}


def default_out_dir(w: StageWorkload, device: torch.device) -> Path:
    quant = f"-{w.model.quantization}" if w.model.quantization != "auto" else ""
    return ROOT / "benchmarks" / "results" / f"stages_vs_trl-{w.stage}-{w.model.model_name_or_path}{quant}-{device.type}"


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    log_to_stdout()
    if "--rescore" in argv:  # --rescore DIR: a result's saved adapters scored again by today's trainer.evaluate
        return rescore(Path(_flag(argv, "rescore", "")), argv)
    w = StageWorkload.parse(argv)
    w.check()
    return run_benchmark(w, argv)


def rescore(out_dir: Path, argv: list[str]) -> dict:
    """Score every finished side's adapter of the result in `out_dir` again with the current evaluation code (a
    metric added since the run, e.g. an interval), and count the tokens each side computed from its saved row
    trace where the result lacks them; record when, at which revision and with which command. The measured
    figures (times, memory) are left as they were."""
    from foundation.provenance import provenance

    path = out_dir / "stages_vs_trl.json"
    if not path.is_file():
        raise UsageError(f"--rescore {out_dir}: no stages_vs_trl.json there")
    report = json.loads(path.read_text())
    w = StageWorkload.from_dict(report["settings"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = None
    for name, side in report["sides"].items():
        if side.get("status") == "ok" and side.get("adapter"):
            logger.info("re-scoring %s (%s)", name, side["adapter"])
            side["evaluation"] = evaluate_side(w, side)
        saved = out_dir / name / "side.json"  # the side's own record keeps its row trace
        if side.get("computed_tokens_per_step") is None and saved.is_file():
            from benchmarks.workload import load_bench_tokenizer

            if rows is None:
                rows = training_rows(w, load_bench_tokenizer(w.model))
            side["computed_tokens_per_step"] = computed_tokens(w, rows, json.loads(saved.read_text())["trace"])
            side["summary"] = summarize(side, report["rows"]["tokens_per_step"], w.bench.warmup_runs)
    if {"ours", "trl"} <= set(report["sides"]):
        report["ratios"] = ratios(report["sides"]["ours"]["summary"], report["sides"]["trl"]["summary"])
    run = provenance(device, _command(argv))
    report["rescored"] = {k: run[k] for k in ("date", "git_revision", "command", "device")}
    write_report(report, out_dir)
    logger.info("re-scored %s", out_dir / "stages_vs_trl.md")
    return report


def run_benchmark(w: StageWorkload, argv: list[str]) -> dict:
    from benchmarks.workload import load_bench_tokenizer
    from foundation.provenance import provenance

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(w.bench.out_dir) if w.bench.out_dir else default_out_dir(w, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = training_rows(w, load_bench_tokenizer(w.model))  # fails here, before any side runs, when the data is too short
    tokens = step_tokens(w, rows)
    command = _command(argv)
    report = {"kind": "stages_vs_trl", "stage": w.stage, "device_kind": device.type, **provenance(device, command),
              "trl_version": library_versions(["trl"])["trl"], "settings": w.to_dict(),
              "rows": {"train_rows": len(rows), "rows_per_step": w.rows_per_step,
                       "tokens_per_step_mean": statistics.fmean(tokens), "tokens_per_step": tokens},
              "sides": {}}
    layouts = [step_rows(w, expected_trace(w, rows, shared)) for shared in (False, True)]
    for name in w.side_list:
        side = run_side(name, w, out_dir)
        side["label"] = SIDE_NAMES[w.stage].get(name) or ABLATION_NAMES[name]
        # every optimizer step trained on exactly the planned rows (micro-batch grouping and pair layout aside)
        trace = side.pop("trace", None)
        side["rows_as_planned"] = step_rows(w, trace) in layouts if trace is not None else None
        side["computed_tokens_per_step"] = computed_tokens(w, rows, trace) if trace is not None else None
        if side.get("status") == "ok" and w.bench.evaluate:
            side["evaluation"] = evaluate_side(w, side)
        side["summary"] = summarize(side, tokens, w.bench.warmup_runs)
        report["sides"][name] = side
        if {"ours", "trl"} <= set(report["sides"]):
            report["ratios"] = ratios(report["sides"]["ours"]["summary"], report["sides"]["trl"]["summary"])
        write_report(report, out_dir)
    logger.info("wrote %s", out_dir / "stages_vs_trl.md")
    return report


def write_report(report: dict, out_dir: Path) -> None:
    from benchmarks.stages_report import render_markdown

    (out_dir / "stages_vs_trl.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "stages_vs_trl.md").write_text(render_markdown(report))


def _command(argv: Sequence[str]) -> str:
    """This command as run from the repo root, absolute paths made relative to it (foundation.provenance's rule)."""
    from foundation.provenance import relative_command

    return "python -m benchmarks.stages_vs_trl " + relative_command(list(argv))


if __name__ == "__main__":
    run(main)
