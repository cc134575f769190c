"""The tables of the results under benchmarks/results/: every folder in docs/results.md, and in README.md the
newest result of each benchmark a user reads (GPU first).

    python -m benchmarks.results_table            # rewrite both tables
    python -m benchmarks.results_table --check    # exit 1 when either table differs from the files
    python -m benchmarks.results_table --print    # the full table on stdout (links from the repository root)

A row: the benchmark, its setting, the headline figure, the device, the date and a link to the folder's
report. Every cell comes from the folder's files and their provenance; none is typed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from foundation.cli import InputError, UsageError, argument_parser, run
from foundation.files import write_atomic
from profiling.report import table_lines

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
COMMAND = "python -m benchmarks.results_table"
STAGES = ("sft", "reward", "dpo", "ppo", "grpo", "rloo")
TRAINERS = {"sft": ("SFT", "SFTTrainer"), "reward": ("Reward model", "RewardTrainer"), "dpo": ("DPO", "DPOTrainer")}


@dataclass
class Row:
    rank: tuple  # where the row sorts: benchmark kind first (the GPU kit's at 0), then its order within the kind
    benchmark: str
    setting: str
    headline: str
    device: str
    date: str  # the provenance's ISO date and time: the newest row of a benchmark is the README's
    report: str  # path of the folder's report, relative to benchmarks/results/
    key: str = ""  # the benchmark the README shows one row of, when not `benchmark` (stages of one comparison)
    user: bool = True  # False: a check of the project's own machinery, in docs/results.md only


@dataclass(frozen=True)
class Page:
    prefix: str  # the results folder as a link from the page
    summary: bool  # the newest user row of each benchmark (README) rather than every folder's


PAGES = {ROOT / "README.md": Page("benchmarks/results", summary=True),
         ROOT / "docs" / "results.md": Page("../benchmarks/results", summary=False)}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable JSON file ({exc})") from exc


def _when(record: dict) -> tuple[str, str]:
    """(device, date) from a file's provenance."""
    return record.get("device_name") or record.get("device") or "?", record.get("date") or "?"


def _report(folder: Path, preferred: str = "README.md") -> str:
    """The page to link for a folder (relative to the results folder): `preferred`, else its first Markdown file,
    else the folder itself."""
    if (folder / preferred).is_file():
        return f"{folder.name}/{preferred}"
    pages = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.md"))
    return f"{folder.name}/{pages[0]}" if pages else f"{folder.name}/"


def _ci(interval: Optional[list]) -> str:
    return f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""


def ppo_vs_trl(folder: Path) -> Row:
    rep = _load(folder / "ppo_vs_trl.json")
    s, used, sides = rep["settings"], rep.get("resolved") or {}, rep["sides"]
    setting = (f"{s['model_name_or_path']} (quantization {used.get('quantization', '?')}, {used.get('dtype', '?')}), "
               f"{s['rollout_batch_size']} prompts x ({s['max_prompt_length']} + {s['max_new_tokens']}) tokens, "
               f"{s['ppo_epochs']} epochs, compile_layers {'on' if s.get('compile_layers') else 'off'}; "
               f"sides {s['sides'].replace(',', ', ')}")
    step = {name: (side.get("summary") or {}).get("step_s") for name, side in sides.items()}
    if step.get("ours") and step.get("trl"):
        headline = f"step {step['ours']:.2f} s, TRL {step['trl']:.2f} s: {step['trl'] / step['ours']:.2f}x"
        if step.get("ours_eager"):
            headline += f"; ours uncompiled {step['ours_eager']:.2f} s: {step['trl'] / step['ours_eager']:.2f}x"
        ratios = rep.get("ratios") or {}
        memory = ratios.get("peak_allocated_trl_over_ours") or ratios.get("peak_rss_trl_over_ours")
        kind = "peak allocated" if ratios.get("peak_allocated_trl_over_ours") else "peak RSS"
        if memory:
            headline += f"; {kind} TRL / ours {memory:.2f}x"
    else:
        headline = "; ".join(f"{name} {side.get('status')}" for name, side in sides.items())
    return Row((1, 0), "PPO step, ours vs TRL PPOTrainer", setting, headline, *_when(rep),
               f"{folder.name}/ppo_vs_trl.md")


def stages_vs_trl(folder: Path) -> Row:
    rep = _load(folder / "stages_vs_trl.json")
    stage, train = rep["stage"], rep["settings"]["train"]
    rows = train["micro_batch_size"] * train["gradient_accumulation_steps"]
    setting = (f"{rep['settings']['model']['model_name_or_path']}, {train['max_steps']} steps x {rows} "
               f"{'rows' if stage == 'sft' else 'pairs'}, max_length {rep['settings']['data']['max_length']}")
    ours, trl = (rep["sides"][n].get("evaluation") or {} for n in ("ours", "trl"))
    if stage == "sft":
        quality = (f"held-out perplexity {ours['perplexity']:.3f}{_ci(ours.get('perplexity_ci95'))}, "
                   f"TRL {trl['perplexity']:.3f}{_ci(trl.get('perplexity_ci95'))} ({ours['rows']} rows)")
    else:
        key = "accuracy" if stage == "reward" else "rewards/accuracies"
        name = "accuracy" if stage == "reward" else "implicit-reward accuracy"
        quality = (f"held-out {name} {ours[key]:.3f}{_ci(ours.get('accuracy_ci95'))}, "
                   f"TRL {trl[key]:.3f}{_ci(trl.get('accuracy_ci95'))} ({ours['pairs']:.0f} pairs)")
    ratios = rep["ratios"]
    headline = (f"{quality}; tokens/s {ratios['tokens_per_s_ratio']:.2f}x TRL's; "
                f"peak RSS TRL / ours {ratios['peak_rss_trl_over_ours']:.2f}x")
    name, trainer = TRAINERS[stage]
    return Row((2, STAGES.index(stage)), f"{name} stage, ours vs TRL {trainer}", setting,
               headline, *_when(rep), f"{folder.name}/stages_vs_trl.md", key="stages_vs_trl")


def estimate(folder: Path) -> Row:
    est = _load(folder / "estimate.json")
    s = est["config"]["settings"]
    setting = (f"{s['model_name_or_path']} {s['stage']}, {s['quantization']}, {s['optimizer']}, LoRA r={s['lora_r']}, "
               f"checkpointing {'on' if s['gradient_checkpointing'] else 'off'}")
    headline = (f"predicted peak {est['peak_bytes'] / 2**30:.3f} GiB ({est['peak_phase']}) against "
                f"{est['budget_bytes'] / 2**30:.0f} GiB: {'fits' if est['fits'] else 'does not fit'}")
    return Row((3, 0), "memory estimate (a prediction, not a measurement)", setting, headline, *_when(est),
               f"{folder.name}/estimate.md")


def cards(folder: Path) -> Row:
    """Which card sizes hold a recipe, by the estimator (`profiling.estimate --cards --out_dir`)."""
    record = _load(folder / "cards.json")
    fits = [f"{r['card_gib']:g}" for r in record["rows"] if r["fits"]]
    left = [f"{r['card_gib']:g}" for r in record["rows"] if not r["fits"]]
    smallest = record.get("smallest_gib")
    headline = (f"smallest card that holds it: {smallest:g} GiB" if smallest is not None else "no card listed holds it")
    headline += f" (fits {', '.join(fits) or 'none'}; not {', '.join(left) or 'none'})"
    return Row((3, 1), "cards that hold a recipe (`profiling.estimate --cards`, a prediction)",
               f"{record['model']} {record['stage']}, {record.get('setting', '-')}", headline, *_when(record),
               f"{folder.name}/cards.md")


def _stage_figure(folder: Path, stage: str) -> Optional[str]:
    """The held-out figure of one stage of a training run: before -> after, or the final evaluation."""
    res = _load(folder / stage / "results.json")
    before, after = res.get("eval_before") or {}, res.get("eval_after") or {}
    for final in sorted(folder.glob(f"{stage}/evaluation*.json")):  # `trainer.evaluate --output_file`: all pairs
        ev = _load(final)
        if "rewards/accuracies" in ev:
            return (f"{stage} implicit-reward accuracy {ev['rewards/accuracies']:.3f}{_ci(ev.get('accuracy_ci95'))} "
                    f"({ev['pairs']:.0f} pairs)")
    for key, name, fmt in (("eval/perplexity", "perplexity", ".2f"), ("eval/accuracy", "accuracy", ".2f"),
                           ("eval/rewards/accuracies", "implicit-reward accuracy", ".2f")):
        if key in after:
            # DPO starts with policy == reference: every implicit reward is 0 and no pair is ranked yet
            start = f"{before[key]:{fmt}} -> " if key in before and stage != "dpo" else ""
            pairs = f" ({after['eval/pairs']:.0f} pairs)" if "eval/pairs" in after else ""
            return f"{stage} {name} {start}{after[key]:{fmt}}{pairs}"
    return None


def training_run(folder: Path) -> Row:
    prov = _load(folder / "provenance.json") if (folder / "provenance.json").is_file() else {}
    stages = [s for s in STAGES if (folder / s / "results.json").is_file()]
    configs = {s: _load(folder / s / "config.json") for s in stages if (folder / s / "config.json").is_file()}
    model = next((c["model"]["model_name_or_path"] for c in configs.values()), "?")
    setting = f"{model}; " + ", ".join(f"{s} {c['train']['max_steps']} steps" for s, c in configs.items())
    comparison = _load(folder / "comparison.json") if (folder / "comparison.json").is_file() else {}
    compared = [s for s in (comparison.get("policies") or {}) if s != "sft"]
    figures = [f for s in stages if s not in compared for f in [_stage_figure(folder, s)] if f]
    if compared:
        figures.append(f"reward-model win rate vs SFT on {comparison['prompts']} held-out prompts: " + ", ".join(
            f"{s} {comparison['policies'][s]['win_rate_vs_sft']:.2f}" for s in compared))
    return Row((4, 0), "training run (`benchmarks.collect_run`)", setting, "; ".join(figures), *_when(prov),
               _report(folder, "report.md"))


def learning_margin(folder: Path, result: dict) -> Row:
    figures = []
    stages = list(dict.fromkeys(r["stage"] for r in result["runs"]))
    for stage in stages:
        gains = [r["gain"] for r in result["runs"] if r["stage"] == stage and not r["flipped"]]
        flipped = [r["gain"] for r in result["runs"] if r["stage"] == stage and r["flipped"]]
        figure = f"{stage} gain over SFT {min(gains):+.2f} to {max(gains):+.2f} in {len(gains)} runs"
        figures.append(figure + (f", flipped update {max(flipped):+.2f}" if flipped else ""))
    seeds = sorted({r["seed"] for r in result["runs"]})
    threads = sorted({r["threads"] for r in result["runs"]})
    setting = (f"{', '.join(stages)} learning checks, seeds {', '.join(map(str, seeds))}, "
               f"threads {', '.join(map(str, threads))}"
               + (", and the update's sign flipped" if any(r["flipped"] for r in result["runs"]) else ""))
    return Row((5, 0), "learning margin (`benchmarks.learning_margin`)", setting, "; ".join(figures),
               *_when(result["provenance"]), f"{folder.name}/README.md")


def launches(folder: Path, result: dict) -> Row:
    from benchmarks.launches import column

    runs = result["revisions"]
    first, last = runs[0]["per_layer"], runs[-1]["per_layer"]
    revisions = " -> ".join(column(r, runs) for r in (runs[0], runs[-1]))
    figures = ", ".join(f"{label} {first[key]} -> {last[key]}" for key, label in
                        (("ppo_update", "PPO update"), ("ppo_scoring", "PPO scoring"), ("grpo_update", "GRPO update"),
                         ("compiled_decode_matmuls", "compiled decode step's matmuls"),
                         ("compiled_decode_traced", "bytecode traced to compile it"))
                        if key in first and key in last)
    architecture = result.get("architecture", "llama")
    # counts depend on the torch that traced them: named where every column shares it (else the columns name it)
    torches = {r.get("versions", {}).get("torch") for r in runs}
    details = ([architecture] if architecture != "llama" else []) + (
        [f"torch {torches.pop()}"] if len(torches) == 1 and None not in torches else [])
    return Row((8, 1), "operations launched per decoder layer (`benchmarks.launches`"
               + "".join(f", {d}" for d in details) + ")", revisions, figures, *_when(result), _report(folder),
               user=False)


def probe(folder: Path) -> Row:
    result = _load(folder / "result.json")
    if "revisions" in result:
        return launches(folder, result)
    if "runs" in result:
        return learning_margin(folder, result)
    return other(folder)


def other(folder: Path) -> Row:
    """A folder of a kind this table does not know (a GPU kit part, say): its provenance and first report."""
    prov = _load(folder / "provenance.json") if (folder / "provenance.json").is_file() else {}
    return Row((7, 0), folder.name, prov.get("command", "-"), "see the report", *_when(prov), _report(folder),
               user=False)


def gpu_kit(folder: Path) -> Row:
    """A part of the GPU kit (benchmarks/gpu/), collected from its archive: how many of its steps ran, and on a
    GPU the figures its result files hold (each a revision's own where it is not the part's: a step the budget
    cut keeps an earlier run's files)."""
    prov = _load(folder / "provenance.json") if (folder / "provenance.json").is_file() else {}
    steps = prov.get("steps") or {}
    ok = sum(1 for s in steps.values() if s.get("status") == "ok")
    seconds = prov.get("seconds")
    headline = f"{ok} of {len(steps)} steps ok" + ("" if seconds is None else f" in {seconds:.0f} s")
    if not prov.get("smoke"):
        headline = "; ".join([headline, *gpu_figures(folder, prov.get("git_revision") or "")])
    mode = "smoke, tiny preset on the CPU" if prov.get("smoke") else prov.get("model", "?")
    part = prov.get("part", folder.name)
    return Row((0, 0), f"GPU kit `{part}` ({mode})", prov.get("command", "-"), headline, *_when(prov),
               f"{folder.name}/manifest.json", user=not prov.get("smoke") and part != "check")  # check: the GPU tests


def gpu_figures(folder: Path, revision: str) -> list[str]:
    """The headline figures of a GPU kit part's result files: a step against TRL's, decoding at 16 rows, the
    estimator's whole-phase figures against the measured ones."""

    def at(data: dict) -> str:
        own = data.get("git_revision") or ""
        return "" if not own or own == revision else f" (at `{own[:7]}`)"

    figures = []
    for path in sorted(folder.glob("*/ppo_vs_trl.json")):
        data = _load(path)
        sides = {name: (side.get("summary") or {}).get("step_s") for name, side in (data.get("sides") or {}).items()
                 if side.get("status") == "ok"}
        if sides.get("ours") and sides.get("trl"):
            figures.append(f"PPO step {sides['ours']:.2f} s, TRL's {sides['trl']:.2f} s{at(data)}")
    for path in sorted(folder.glob("*/grpo_vs_trl.json")):
        data = _load(path)
        ratios = data.get("ratios") or {}
        if ratios.get("step_s_ours_over_trl") and ratios.get("peak_reserved_bytes_ours_over_trl"):
            figures.append(f"GRPO step {ratios['step_s_ours_over_trl']:.2f}x TRL's, peak reserved "
                           f"{ratios['peak_reserved_bytes_ours_over_trl']:.2f}x{at(data)}")
    for path in sorted(folder.glob("*/decode.json")):
        data = _load(path)
        at_16 = [r for r in data.get("rows") or [] if r.get("batch") == 16 and r.get("ms_per_step")]
        if at_16:
            best = min(at_16, key=lambda r: r["ms_per_step"])
            figures.append(f"decoding 16 rows {best['ms_per_step']:.2f} ms a step ({best['path']}, "
                           f"{best.get('weights', 'quantized')}){at(data)}")
    ratios = [p["total_ratio"] for path in sorted(folder.glob("*/vs_estimate.json"))
              for p in _load(path).get("phases") or [] if p.get("total_ratio") is not None]
    if ratios:
        figures.append(f"measured / estimated device memory per phase {min(ratios):.2f}-{max(ratios):.2f}")
    return figures


def activation_check(folder: Path) -> Row:
    """The estimator's activation and logit terms against the CPU allocator's, per stage and phase."""
    result = _load(folder / "activation_check.json")

    def count(term: str, phase_is_step: bool = False) -> str:
        held = [row[term] for row in result["rows"] if row[term]["held"]
                and (row["phase"] == "optimizer_step") == phase_is_step]
        return f"{sum(1 for t in held if t['within'])} of {len(held)}"

    return Row((4, 2), "activations measured on the CPU (`benchmarks.activation_check`)",
               "sft, reward, dpo, ppo, grpo on the tiny preset and SmolLM2, with and without checkpointing",
               f"terms of >= {result['significant_bytes'] // 2**20} MiB within {result['tolerance']:.0%} of the "
               f"estimate: layer activations {count('activations')}, logits {count('logits')}, optimizer "
               f"temporaries {count('activations', True)}, phase peaks {count('transient')}",
               *_when(result["provenance"]), _report(folder))


def arithmetic_task(folder: Path) -> Row:
    """Held-out exact match on the arithmetic task before and after GRPO (`benchmarks.arithmetic.report`)."""
    result = _load(folder / "arithmetic.json")
    before, after, training = result["before"], result["after"], result["training"]
    s = training["settings"]
    functions = ", ".join(spec.rsplit(":", 1)[-1] for spec in s["stage"]["reward_fn"].split(","))
    setting = (f"{s['model']['model_name_or_path']}, GRPO {training['steps']} steps x "
               f"{s['stage']['rollout_batch_size']} prompts x {s['stage']['num_generations']}, reward functions "
               f"{functions}; {before['rows']} held-out problems, greedy")

    def change(name: str) -> str:
        b, a = before["checks"][name], after["checks"][name]
        return f"{b['mean']:.3f}{_ci(b['ci95'])} -> {a['mean']:.3f}{_ci(a['ci95'])}"

    headline = (f"exact match {change('correct')}; format {change('formatted')}; mean length "
                f"{before['mean_length']['mean']:.1f} -> {after['mean_length']['mean']:.1f} tokens")
    return Row((4, 3), "arithmetic task, GRPO with reward functions (`benchmarks/arithmetic/recipe.sh`)", setting,
               headline, *_when(after["provenance"]), _report(folder))


KINDS: list[tuple[str, Callable[[Path], Row]]] = [  # the file that marks a folder's kind, in the order tried
    ("manifest.json", gpu_kit), ("activation_check.json", activation_check), ("ppo_vs_trl.json", ppo_vs_trl), ("stages_vs_trl.json", stages_vs_trl), ("estimate.json", estimate), ("cards.json", cards),
    ("arithmetic.json", arithmetic_task), ("result.json", probe)]


def row_for(folder: Path) -> Row:
    for name, reader in KINDS:
        if (folder / name).is_file():
            return reader(folder)
    if any((folder / s / "results.json").is_file() for s in STAGES):
        return training_run(folder)
    return other(folder)


def rows(results: Path = RESULTS) -> list[Row]:
    folders = sorted(p for p in results.iterdir() if p.is_dir() and not p.name.startswith("."))
    return sorted((row_for(f) for f in folders), key=lambda r: (r.rank, r.report))


def newest_of_each(all_rows: list[Row]) -> list[Row]:
    """The newest user row of each benchmark, in the table's order: the README's rows."""
    newest: dict[str, Row] = {}
    for r in all_rows:
        key = r.key or r.benchmark
        if r.user and (key not in newest or r.date > newest[key].date):
            newest[key] = r
    kept = {id(r) for r in newest.values()}
    return [r for r in all_rows if id(r) in kept]


def table(results: Path = RESULTS, page: Page = Page("benchmarks/results", summary=False)) -> str:
    """The Markdown table for `page`: its rows, links starting with its prefix."""
    chosen = rows(results)
    return "\n".join(table_lines(["benchmark", "setting", "headline", "device", "date", "result"], "llllll", [
        [r.benchmark, r.setting, r.headline, r.device, r.date[:10], f"[{r.report.split('/')[0]}]({page.prefix}/{r.report})"]
        for r in (newest_of_each(chosen) if page.summary else chosen)])) + "\n"


def section(results: Path, page: Page) -> str:
    return (f"{START}\n\n_Generated by `{COMMAND}` from the files under `benchmarks/results/`; do not edit by "
            f"hand._\n\n{table(results, page)}\n{END}")


def rewritten(path: Path, results: Path, page: Page) -> tuple[str, str]:
    """(the file's text now, its text with the table regenerated)."""
    text = path.read_text()
    if START not in text or END not in text:
        raise InputError(f"{path}: no {START} ... {END} section for the table")
    head, rest = text.split(START, 1)
    return text, head + section(results, page) + rest.split(END, 1)[1]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argument_parser(COMMAND, __doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 when a page's table is stale; write nothing.")
    parser.add_argument("--print", action="store_true", help="Print the full table; write nothing.")
    parser.add_argument("--results_dir", type=Path, default=RESULTS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.check and args.print:
        raise UsageError("--check and --print: pick one")
    if args.print:
        print(table(args.results_dir), end="")
        return 0
    stale = []
    for path, page in PAGES.items():
        now, new = rewritten(path, args.results_dir, page)
        if now != new:
            stale.append(path.relative_to(ROOT).as_posix())
            if not args.check:
                write_atomic(path, new)
    if args.check and stale:
        raise InputError(f"stale results table in {', '.join(stale)}: run {COMMAND}")
    done = "stale: none" if args.check else f"rewrote: {', '.join(stale) or 'none (already current)'}"
    print(f"results table, {len(rows(args.results_dir))} rows; {done}")
    return 0


if __name__ == "__main__":
    run(main)
