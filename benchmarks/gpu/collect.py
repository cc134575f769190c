"""The GPU kit, back on a development machine: unpack the parts' archives and regenerate the GPU tables of
docs/gpu-results.md from the files they hold (no figure typed by hand).

    python -m benchmarks.gpu.collect [ARCHIVE ...]

Each archive becomes `benchmarks/results/PART-MODEL-GPU/` (smoke: `PART-MODEL-smoke/`) with
`provenance.json`; then the `gpu-results` section of docs/gpu-results.md is rewritten from every GPU result
folder (with no archive, only that section).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Optional

from foundation.cli import InputError, argument_parser, run
from foundation.files import atomic_folder, check_writable, reported_write_failure, write_atomic
from profiling.components import gib
from profiling.report import table_lines, table_row

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GPU_RESULTS = ROOT / "docs" / "gpu-results.md"
START, END = "<!-- gpu-results:start -->", "<!-- gpu-results:end -->"
MAX_UNPACKED = 256 * 2**20  # bytes an archive may unpack to: the kit's largest part packs a few MiB
MAX_MEMBERS = 4096  # files and folders an archive may hold: a part packs fewer than a hundred


# A result folder's name is made of manifest fields and replaces what is there: plain names only, so an
# absolute or `../` field can never reach outside the results folder.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _found(manifest: dict, key: str) -> str:
    return f"not {repr(manifest[key])[:80]}" if key in manifest else "and it is missing"


def _name_field(manifest: dict, key: str, archive: Path) -> str:
    value = manifest.get(key)
    if not isinstance(value, str) or not NAME.fullmatch(value) or ".." in value:
        raise InputError(f"{archive}: manifest.json's {key!r} must be a plain name (letters, digits, '.', '_', '-'; "
                         f"no '..'), {_found(manifest, key)}")
    return value


def folder_name(manifest: dict, archive: Path) -> str:
    """PART-MODEL-GPU (a smoke run's: PART-MODEL-smoke), or an InputError naming the field that cannot be used."""
    from benchmarks.gpu.parts import PARTS

    if not isinstance(manifest.get("smoke"), bool):
        raise InputError(f"{archive}: manifest.json's 'smoke' must be true or false, {_found(manifest, 'smoke')}")
    part = _name_field(manifest, "part", archive)
    if part not in PARTS:  # a results folder of another benchmark is never replaced by an archive
        raise InputError(f"{archive}: manifest.json's 'part' must be one of the GPU kit's ({', '.join(PARTS)}), "
                         f"{_found(manifest, 'part')}")
    if not manifest["smoke"] and manifest.get("device") != "cuda":
        raise InputError(f"{archive}: a part that is not a smoke run must have run on cuda, "
                         f"{_found(manifest, 'device')}")
    device = "smoke" if manifest["smoke"] else _name_field(manifest, "device_slug", archive)
    return f"{part}-{_name_field(manifest, 'model', archive)}-{device}"


def step_summary(manifest: dict, archive: Path) -> dict:
    steps = manifest.get("steps")
    if not isinstance(steps, list) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("status"), str)
            and isinstance(s.get("seconds"), (int, float)) and not isinstance(s.get("seconds"), bool)
            for s in steps):
        raise InputError(f"{archive}: manifest.json's 'steps' must be a list of objects with a name, a status "
                         "and seconds")
    return {s["name"]: {"status": s["status"], "seconds": round(s["seconds"], 1)} for s in steps}


def checked_members(tar: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    """The archive's members, read one header at a time up to MAX_MEMBERS, then refused past it (before
    anything is unpacked or the rest of the archive is read), past MAX_UNPACKED bytes, or with a member that is
    not a plain file or folder (links, devices) or whose name is absolute or holds `..`: the kit packs none,
    and each could write outside the extraction folder."""
    members = []
    for member in tar:
        members.append(member)
        if len(members) > MAX_MEMBERS:
            raise InputError(f"{archive}: refused: it holds more than {MAX_MEMBERS:,} members, past what a part's "
                             "results take")
    unpacked = sum(member.size for member in members if member.isfile())
    if unpacked > MAX_UNPACKED:
        raise InputError(f"{archive}: refused: it unpacks to {unpacked:,} bytes, past the {MAX_UNPACKED:,} a part's "
                         "results take")
    for member in members:
        if not (member.isfile() or member.isdir()):
            raise InputError(f"{archive}: refused: member {member.name!r} is a link or a special file")
        if member.name.startswith("/") or ".." in PurePosixPath(member.name).parts:
            raise InputError(f"{archive}: refused: member {member.name!r} would land outside its folder")
    return members


def read_manifest(archive: Path, folder: Path) -> tuple[Path, dict]:
    """(the part's folder, its manifest as an object) from an extracted archive, or an InputError."""
    manifests = list(folder.glob("*/manifest.json"))
    if len(manifests) != 1:
        raise InputError(f"{archive}: expected one PART/manifest.json inside, found {len(manifests)}")
    try:
        manifest = json.loads(manifests[0].read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, huge int
        raise InputError(f"{archive}: its manifest.json is not valid JSON ({' '.join(str(exc).split())[:200]})"
                         ) from None
    if not isinstance(manifest, dict):
        raise InputError(f"{archive}: its manifest.json is not a JSON object but {type(manifest).__name__}")
    return manifests[0].parent, manifest


def check_tables(folder: Path, archive: Path) -> None:
    """Every file of the part that docs/gpu-results.md tabulates is read as the tables read it, before anything
    is written: a malformed one is one InputError naming it, never a traceback in this or a later collect."""
    for rows in (memory_rows, estimate_rows, decode_rows, decode_path_rows, trl_rows, kernel_rows):
        try:
            rows(folder)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, OSError) as exc:
            raise InputError(f"{archive}: refused: a results file the GPU tables read is malformed "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None


def unpack(archive: Path, results: Path) -> Path:
    """One part's archive into results/NAME/ (replacing an earlier copy), with its provenance. An archive or
    manifest that cannot be used is one InputError, and then nothing is written or removed."""
    if not archive.is_file():
        raise InputError(f"{archive}: no such archive")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            tar = tarfile.open(archive)
        except tarfile.ReadError:  # its message lists every decompressor tried, one a line
            raise InputError(f"{archive}: not a tar archive (plain, or compressed with gzip, bzip2 or xz)") from None
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise InputError(f"{archive}: not a readable archive ({' '.join(str(exc).split())[:200]})") from None
        try:
            with tar:
                members = checked_members(tar, archive)
                # tarfile's "data" filter (Python 3.11.4+, 3.10.12+) checks each member again as it extracts
                tar.extractall(tmp, members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise InputError(f"{archive}: not a readable archive ({' '.join(str(exc).split())[:200]})") from None
        source, manifest = read_manifest(archive, Path(tmp))
        target = results / folder_name(manifest, archive)
        check_tables(source, archive)
        provenance = {k: manifest.get(k) for k in ("part", "model", "smoke", "device", "device_name", "device_slug",
                                                    "driver", "date", "command", "git_revision", "host", "versions", "seconds",
                                                    "budget_s")}
        provenance.update(archive=archive.name, steps=step_summary(manifest, archive))
        earlier = finished_steps(target)
        with atomic_folder(target) as folder:
            shutil.copytree(source, folder, dirs_exist_ok=True)
            kept = keep_finished(earlier, target, manifest, folder)
            if kept:
                provenance["kept"] = kept
            (folder / "provenance.json").write_text(json.dumps(provenance, indent=2))
    return target


def step_folder(step: dict) -> Optional[str]:
    """The folder a step wrote its results to, relative to its part's folder (its --out_dir / --output_dir)."""
    argv = step.get("argv") if isinstance(step.get("argv"), list) else []
    for flag in ("--out_dir", "--output_dir"):
        if flag in argv[:-1]:
            name = PurePosixPath(str(argv[argv.index(flag) + 1])).name
            return name if NAME.fullmatch(name) and ".." not in name else None
    return None


def finished_steps(target: Path) -> dict[str, dict]:
    """The steps an earlier copy of a part's folder holds finished results of: {step: {folder, git_revision,
    date}}, from its manifest (status ok) and the steps it kept itself."""
    try:
        manifest = json.loads((target / "manifest.json").read_text())
        kept = json.loads((target / "provenance.json").read_text()).get("kept") or {}
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return {}
    finished = {name: info for name, info in kept.items() if isinstance(info, dict)}
    for step in manifest.get("steps") or []:
        if isinstance(step, dict) and step.get("status") == "ok" and step_folder(step):
            finished[step["name"]] = {"folder": step_folder(step), "git_revision": manifest.get("git_revision"),
                                      "date": manifest.get("date")}
    return finished


def keep_finished(earlier: dict[str, dict], target: Path, manifest: dict, folder: Path) -> dict[str, dict]:
    """The results of steps this run did not finish (cut by its budget, failed) that an earlier run had,
    copied into the new folder in place of what the unfinished step left: `benchmarks/results/` keeps the
    latest finished run of each benchmark. Each kept folder's files carry their own revision and date;
    provenance.json names them under `kept`, and the earlier log is beside the new one as STEP.kept.log."""
    kept = {}
    for step in manifest.get("steps") or []:
        name = step.get("name") if isinstance(step, dict) else None
        info = earlier.get(name)
        if step.get("status") == "ok" or info is None:
            continue
        sub_folder = info.get("folder")
        if not isinstance(sub_folder, str) or not NAME.fullmatch(sub_folder) or ".." in sub_folder:
            continue
        source = target / sub_folder
        if not source.is_dir():
            continue
        shutil.rmtree(folder / sub_folder, ignore_errors=True)  # what the unfinished step left (the log keeps it)
        shutil.copytree(source, folder / sub_folder)
        log = target / "logs" / f"{name}.log"
        if log.is_file():
            (folder / "logs").mkdir(exist_ok=True)
            shutil.copy2(log, folder / "logs" / f"{name}.kept.log")
        kept[name] = info
    return kept


def _cell(value) -> str:
    """A table cell from a file's text: no markup, no column break, no line break, a readable length."""
    text = " ".join(str(value).split()).replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text if len(text) <= 60 else text[:60] + "..."


def gpu_folders(results: Path, part: str) -> list[Path]:
    found = []
    for folder in sorted(results.glob(f"{part}-*")):
        info = folder / "provenance.json"
        if info.is_file() and not json.loads(info.read_text()).get("smoke") and \
                json.loads(info.read_text()).get("device") == "cuda":
            found.append(folder)
    return found


def run_folders(folder: Path, file: str) -> list[Path]:
    """A result's run folders that hold FILE: the stages in pipeline order, then the rest (e.g. `grpo_8gb`)."""
    order = {"sft": 0, "reward": 1, "ppo": 2, "grpo": 3}
    runs = [path.parent for path in folder.glob(f"*/{file}")]
    return sorted(runs, key=lambda run: (order.get(run.name, len(order)), run.name))


def memory_rows(folder: Path) -> list[str]:
    rows = []
    for run in run_folders(folder, "memory.json"):
        stage = _cell(run.name)
        data = json.loads((run / "memory.json").read_text())
        ended = data.get("ended") if isinstance(data.get("ended"), dict) else None
        for phase in data["phases"]:
            cuda = phase.get("cuda") or {}
            name = _cell(phase["phase"])
            if ended and ended.get("phase") == phase["phase"]:  # where a run that stopped on an error stopped
                name += f" **(stopped here at step {_cell(ended.get('step'))}: {_cell(ended.get('error'))})**"
            rows.append([folder.name, stage, name, *(gib(cuda.get(k), 2) for k in ("peak_allocated", "peak_reserved",
                                                                                  "nvml_used")), gib(data["budget_bytes"], 2)])
        if ended and ended.get("phase") not in {phase["phase"] for phase in data["phases"]}:
            rows.append([folder.name, stage, f"**stopped at step {_cell(ended.get('step'))}, outside the recorded "
                         f"phases: {_cell(ended.get('error'))}**", "-", "-", "-", gib(data["budget_bytes"], 2)])
    return [table_row(row) for row in rows]


def estimate_rows(folder: Path) -> list[str]:
    rows = []
    for run in run_folders(folder, "vs_estimate.json"):
        stage = _cell(run.name)
        for p in json.loads((run / "vs_estimate.json").read_text())["phases"]:
            ratio = "-" if p["total_ratio"] is None else f"{p['total_ratio']:.2f}"
            alloc = p.get("peak_allocated_ratio")
            rows.append([folder.name, stage, _cell(p["phase"]), gib(p.get("measured_peak_allocated"), 2),
                         gib(p.get("predicted_peak_allocated"), 2), "-" if alloc is None else f"{alloc:.2f}",
                         gib(p["measured_total"], 2), gib(p["predicted_total"], 2), ratio])
    return [table_row(row) for row in rows]


def last_metrics(path: Path) -> dict:
    """The last logged training step's metrics in a run's metrics.jsonl ({} when there is none)."""
    last = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "perf/decode_tokens_per_s" in record:
                last = record
    return last


def decode_rows(folder: Path) -> list[str]:
    """Decode speed of each RL run's rollout (its last step: warm), against the bandwidth bound."""
    rows = []
    for run in run_folders(folder, "metrics.jsonl"):
        stage, config_file = _cell(run.name), run / "config.json"
        last = last_metrics(run / "metrics.jsonl")
        if not last or not config_file.is_file():
            continue
        config = json.loads(config_file.read_text())
        stage_config, plan = config.get("stage", {}), config.get("plan", config.get("stage", {}))
        fraction = last.get("perf/decode_bandwidth_fraction")
        rows.append([folder.name, stage, _cell(plan.get("rollout_micro_batch_size")),
                     _cell(stage_config.get("max_new_tokens")), f"{last['perf/decode_tokens_per_s']:.0f}",
                     "-" if fraction is None else f"{fraction:.0%}"])
    return [table_row(row) for row in rows]


def decode_path_rows(folder: Path) -> list[str]:
    """The decode benchmark's rows (`benchmarks.gpu.decode`): each path and batch against the bandwidth bound."""
    return [table_row([folder.name, _cell(run.name), _cell(r["path"]), _cell(r.get("weights", "quantized")),
                       int(r["batch"]),
             f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['bandwidth_fraction']:.1%}",
             f"{r['first_call_s']:.1f}"])
            for run in run_folders(folder, "decode.json") for r in json.loads((run / "decode.json").read_text())["rows"]]


def kernel_rows(folder: Path) -> list[str]:
    """The kernel profiles of a result (`benchmarks.kernels`): each profiled phase's wall time beside its ops'
    device time, and the op with the most device time of its own."""
    rows = []
    for path in sorted(folder.glob("**/kernels.json")):
        report = json.loads(path.read_text())
        clock, ops = report["clock"], report.get("ops") or []
        top = f"{_cell(ops[0]['op'])} ({ops[0]['self_s'] / report['busy_s']:.0%})" if ops and report["busy_s"] else "-"
        for p in report["phases"]:
            if p.get("ops_s") is None:
                continue
            busy = f"{p['ops_s'] / p['wall_s']:.0%}" if p["wall_s"] else "-"
            rows.append([folder.name, _cell(path.parent.relative_to(folder)), _cell(p["phase"]), f"{p['wall_s']:.3f}",
                         f"{p['ops_s']:.3f}", busy, clock, top])
    return [table_row(row) for row in rows]


def _times(summary: dict) -> list[str]:
    return ["-" if summary.get(k) is None else f"{summary[k]:.1f}" for k in ("step_s", "rollout_s", "update_s")]


def trl_rows(folder: Path) -> list[str]:
    """One PPO step of ours against TRL's on the same work: each side's status, step time and peak."""
    path = folder / "ppo_vs_trl" / "ppo_vs_trl.json"
    if not path.is_file():
        return []
    sides = json.loads(path.read_text())["sides"]
    rows = []
    for name in ("ours", "trl"):
        side = sides.get(name)
        if side is None:
            rows.append([folder.name, name, "not reached", "-", "-", "-", "-"])
            continue
        s = side.get("summary") or {}
        rows.append([folder.name, name, _cell(side["status"]), *_times(s), gib(s.get("peak_reserved_bytes"), 2)])
    return [table_row(row) for row in rows]


def grpo_trl_rows(folder: Path) -> list[str]:
    """TRL's QLoRA GRPO recipe on ours and on TRL's GRPOTrainer (`benchmarks.grpo_vs_trl`): each side's times
    and memory, and ours over TRL's."""
    path = folder / "grpo_vs_trl" / "grpo_vs_trl.json"
    if not path.is_file():
        return []
    report = json.loads(path.read_text())
    rows = []
    for name, side in report.get("sides", {}).items():
        s = side.get("summary") or {}
        rows.append([folder.name, _cell(name), _cell(side.get("status")), *_times(s),
                     *(gib(s.get(k), 2) for k in ("peak_allocated_bytes", "peak_reserved_bytes", "nvml_used_max_bytes"))])
    found = report.get("ratios") or {}
    keys = ("step_s", "rollout_s", "update_s", "peak_allocated_bytes", "peak_reserved_bytes", "nvml_used_max_bytes")
    for side in ("ours", "ours_4bit"):  # each of ours over TRL's (benchmarks.grpo_vs_trl.ratios' keys)
        ratios = {k: found.get(f"{k}_{side}_over_trl") for k in keys}
        if any(ratios.values()):
            rows.append([folder.name, f"{side} / TRL", None, *(f"{ratios[k]:.2f}x" if ratios[k] else "-" for k in keys)])
    return [table_row(row) for row in rows]


def _table(caption: str, head: list[str], align: str, rows: list[str]) -> list[str]:
    """A captioned table's lines, none when it has no rows."""
    return ["", caption, "", *table_lines(head, align), *rows] if rows else []


def readme_section(results: Path) -> str:
    folders = [f for part in ("first", "memory", "grpo_recipe", "speed", "grpo_vs_trl") for f in gpu_folders(results, part)]
    lines = [START, "", "_Generated by `python -m benchmarks.gpu.collect` from the files under `benchmarks/results/`; "
             "do not edit by hand._", ""]
    if not folders:
        lines += ["No GPU run has been collected yet: every GPU figure in this project is the estimator's "
                  "prediction. `benchmarks/gpu/README.md` says how to measure them.", "", END]
        return "\n".join(lines)
    lines += ["Measured memory per phase (7B architecture, NF4, under a simulated card of the budget column; a run "
              "that stopped on an error says where):", "",
              *table_lines(["result", "run", "phase", "peak allocated GiB", "peak reserved GiB", "NVML device used GiB",
                            "budget GiB"], "lllrrrr"), *(row for folder in folders for row in memory_rows(folder)),
              "", "Measured against the estimator on the same settings (target ratio 0.85-1.15): the peak the "
              "allocator held for tensors, and the whole phase (device used: the allocator's cache and the CUDA "
              "context too):", "",
              *table_lines(["result", "run", "phase", "peak allocated GiB", "estimated GiB", "ratio", "whole phase GiB",
                            "estimated GiB", "ratio"], "lll" + "r" * 6),
              *(row for folder in folders for row in estimate_rows(folder))]
    speed = gpu_folders(results, "speed")
    lines += _table("Rollout decoding (the run's last step; prefill included), against the bandwidth bound:",
                    ["result", "run", "rows decoded together", "new tokens", "tokens/s", "of the bound"], "llrrrr",
                    [row for folder in folders for row in decode_rows(folder)])
    lines += _table("Decoding alone (`benchmarks.gpu.decode`: 7B NF4, policy adapter, fixed length), per path and "
                    "batch, against the bandwidth bound; first call (warm-up, compilation) apart:",
                    ["result", "run", "path", "weights", "batch", "ms per step", "tokens/s", "of the bound",
                     "first call s"], "llll" + "r" * 5, [row for folder in speed for row in decode_path_rows(folder)])
    lines += _table("Where the time went (`benchmarks.kernels`: one extra step or decode under torch.profiler, which "
                    "slows it; a phase whose device is busy a small share of its wall time is launch-bound):",
                    ["result", "profile", "phase", "wall s", "its ops s", "busy", "clock", "top op (share of busy)"],
                    "lllrrrll", [row for folder in speed for row in kernel_rows(folder)])
    lines += _table("One PPO step on the same 7B work, ours against TRL 1.12 (a side the budget cut has no figure):",
                    ["result", "side", "status", "step s", "rollout s", "update s", "peak reserved GiB"], "lllrrrr",
                    [row for folder in folders for row in trl_rows(folder)])
    lines += _table("TRL's QLoRA GRPO recipe, ours against TRL's GRPOTrainer in the same call and cap (each side its "
                    "own process; the measured step after a warm-up):",
                    ["result", "side", "status", "step s", "rollout s", "update s", "peak allocated GiB",
                     "peak reserved GiB", "NVML device used GiB"], "lll" + "r" * 6,
                    [row for folder in gpu_folders(results, "grpo_vs_trl") for row in grpo_trl_rows(folder)])
    lines += ["", END]
    return "\n".join(lines)


def update_readme(readme: Path, results: Path) -> None:
    try:
        text = readme.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--readme {readme}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if START not in text or END not in text:
        raise InputError(f"{readme}: no {START} ... {END} section to regenerate")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    section = readme_section(results)
    if section.count(START) != 1 or section.count(END) != 1:  # cells are escaped (`_cell`): a last guard
        raise InputError(f"{readme}: the generated section would hold a second {START} or {END}; nothing written")
    write_atomic(readme, head + section + tail)


def main(argv: Optional[list[str]] = None) -> list[Path]:
    parser = argument_parser("python -m benchmarks.gpu.collect", __doc__.splitlines()[0])
    parser.add_argument("archives", nargs="*", type=Path)
    parser.add_argument("--results_dir", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=GPU_RESULTS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_writable(args.results_dir, "--results_dir", folder=True)  # both before an archive is unpacked
    check_writable(args.readme, "--readme")
    folders = []
    for archive in args.archives:
        with reported_write_failure(f"--results_dir {args.results_dir}", args.results_dir):
            folders.append(unpack(archive, args.results_dir))
    for folder in folders:
        print(f"collected {folder}")
    with reported_write_failure(f"--readme {args.readme}", args.readme.parent):
        update_readme(args.readme, args.results_dir)
    print(f"regenerated the GPU section of {args.readme}")
    return folders


if __name__ == "__main__":
    run(main)
