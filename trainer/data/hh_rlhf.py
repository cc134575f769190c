"""hh-rlhf rows: where they come from, which are usable, and how they divide into stage subsets.

Sources (`DataArguments.dataset`): a hub id with `chosen` / `rejected` columns (`dataset_subset` picks one
folder), a local `.jsonl`, `.jsonl.gz` or `.parquet` file or a folder of them (read in path order, so the
row order never depends on the file system), or `"auto"` ($RLHF_DATA, else ../shared/data/hh-rlhf, else
the hub). A row that cannot be a `PreferencePair` is a bad row with a reason (`REASONS`): `on_bad_row="error"`
stops at it naming file and row, `"skip"` counts it. The subsets `eval`, `sft`, `reward` and `ppo` share no prompt.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from foundation.cli import InputError
from foundation.settings import DATA_ENV, HUB_DATASET, DataArguments
from trainer.config import SHARED_DATA

logger = logging.getLogger(__name__)

ASSISTANT = "\n\nAssistant:"
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")

# Reasons a row is dropped, in the order the checks run.
NOT_UTF8 = "not_utf8"
NOT_JSON = "not_json"
NOT_OBJECT = "not_object"
MISSING_FIELD = "missing_field"
NOT_STRING = "not_string"
NO_ASSISTANT_TURN = "no_assistant_turn"
PROMPT_MISMATCH = "prompt_mismatch"
EMPTY_COMPLETION = "empty_completion"
IDENTICAL = "identical"
TOO_LONG = "too_long"  # found at tokenization, see trainer/tokenization.py
NO_REJECTED = "no_rejected"  # a prompt/completion row where a pair is needed (reward, DPO): found at tokenization
NO_PROMPT = "no_prompt"  # a text row where a prompt is needed (PPO / GRPO): found at tokenization
NO_COMPLETION = "no_completion"  # a prompt-only row where a completion is needed (SFT, reward, DPO): likewise
UNREADABLE_FILE = "unreadable_file"  # a whole file, not a row: never skipped
REASONS = (NOT_UTF8, NOT_JSON, NOT_OBJECT, MISSING_FIELD, NOT_STRING, NO_ASSISTANT_TURN, PROMPT_MISMATCH,
           EMPTY_COMPLETION, IDENTICAL, TOO_LONG, NO_REJECTED, NO_PROMPT, NO_COMPLETION)


class DataError(InputError, ValueError):
    """A data source or row that cannot be used; `source` is "file:row" where a row is at fault."""

    def __init__(self, source: str, reason: str, detail: str):
        self.source, self.reason, self.detail = source, reason, detail
        super().__init__(f"{source}: {reason}: {detail}")


@dataclass(frozen=True)
class PreferencePair:
    """One row: the shared prompt (for hh-rlhf, ending with "\\n\\nAssistant:") and the two completions;
    `rejected` is None for a prompt/completion row (SFT and PPO prompts only), both None for a prompt-only
    row (PPO and GRPO only)."""

    prompt: str
    chosen: Optional[str]
    rejected: Optional[str]
    source: str  # "path/to/file.jsonl.gz:123" (1-based row), or "Anthropic/hh-rlhf[train]:123"
    # the row's columns besides its completions, as read (`prompt` as given, `answer`, ...): for reward functions
    columns: dict = field(default_factory=dict, compare=False)


@dataclass
class LoadReport:
    """What loading read and dropped. `skipped` maps a reason from `REASONS` to its row count."""

    dataset: str
    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        dropped = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.skipped.items())) or "none"
        return f"read {self.rows_read} rows from {self.dataset}: kept {self.kept}, skipped {dropped}"

    @property
    def fingerprint(self) -> str:
        """A short hash of what was read (file names below the source and their sizes, or the hub id), so
        a resumed run notices that `--dataset auto` now means other files ($RLHF_DATA); no machine path in it."""
        root = Path(self.dataset).expanduser()
        items = []
        for name in self.files:
            path = Path(name)
            if path.is_file():
                items.append([path.name if root.is_file() else path.relative_to(root).as_posix(), path.stat().st_size])
            else:
                items.append([name, None])
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RawRow:
    """A record as read, before validation: a JSON line (str) or a decoded mapping (parquet, hub)."""

    source: str
    value: Any


# --- where the rows come from -------------------------------------------------------------------

def resolve_dataset(dataset: str) -> str:
    """Turn "auto" into a concrete source: $RLHF_DATA, else the shared folder, else the hub id."""
    if dataset != "auto":
        return dataset
    if os.environ.get(DATA_ENV):
        return os.environ[DATA_ENV]
    if SHARED_DATA.exists():
        return str(SHARED_DATA)
    return HUB_DATASET


def is_hub_id(dataset: str) -> bool:
    """True for an `owner/name` that is not a local path (local paths win when both could apply)."""
    try:
        if Path(dataset).expanduser().exists():
            return False
    except OSError:  # a name no filesystem takes (too long): not a local path; the reader names what it lacks
        pass
    looks_like_path = dataset.startswith((".", "/", "~")) or dataset.endswith(DATA_SUFFIXES) or "\\" in dataset
    return dataset.count("/") == 1 and not looks_like_path


def data_files(path: Path) -> list[Path]:
    """The data files at `path`: the file itself, or every data file below a folder, sorted by path."""
    try:
        exists = path.exists()
    except OSError as exc:  # a name no filesystem takes (too long)
        raise DataError(str(path)[:200], "not_found", f"not a usable path ({exc.strerror})") from None
    if not exists:
        raise DataError(str(path), "not_found", "no such file or folder (set --dataset or $" + DATA_ENV + ")")
    if path.is_file():
        if not path.name.endswith(DATA_SUFFIXES):
            raise DataError(str(path), "unsupported_file", f"expected one of {', '.join(DATA_SUFFIXES)}")
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(DATA_SUFFIXES))
    if not found:
        raise DataError(str(path), "no_data_files", f"folder holds no {', '.join(DATA_SUFFIXES)} files")
    return found


def read_jsonl(path: Path) -> Iterator[RawRow]:
    """Lines of a .jsonl / .jsonl.gz file, parsed later so a bad line names its number.

    Lines are decoded one by one: a line that is not UTF-8 is a bad row of its own (its bytes are
    passed on), not a reason to reject the file. A byte-order mark before the first line is dropped.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield RawRow(f"{path}:{number}", raw)
                continue
            if line.strip():  # blank lines (a trailing newline, say) are not rows
                yield RawRow(f"{path}:{number}", line)


def read_parquet(path: Path) -> Iterator[RawRow]:
    """Rows of a parquet file as mappings; the 1-based row index stands in for the line number."""
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            number += 1
            yield RawRow(f"{path}:{number}", record)


def read_hub(name: str, split: str, subset: Optional[str]) -> Iterator[RawRow]:
    """Rows of a hub dataset through `datasets.load_dataset` (the path for users with a hub)."""
    import datasets

    try:
        table = datasets.load_dataset(name, data_dir=subset, split=split)
    except Exception as exc:  # offline, unknown id, bad split: all end here, none is ours to fix
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise DataError(name, "hub_unavailable",
                        f"no such local file or folder, and as a hub dataset id datasets.load_dataset failed "
                        f"({type(exc).__name__}: {first[:200]})") from None
    label = f"{name}[{subset + '/' if subset else ''}{split}]"
    number = 0
    for batch in table.iter(batch_size=4096):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            number += 1
            yield RawRow(f"{label}:{number}", dict(zip(columns, values)))


def read_file(path: Path) -> Iterator[RawRow]:
    """Rows of one local file; a file that cannot be decoded at all is an error whatever the policy."""
    try:
        yield from (read_parquet(path) if path.name.endswith(".parquet") else read_jsonl(path))
    except (OSError, EOFError, zlib.error, ValueError) as exc:  # bad gzip/parquet bytes, unreadable file
        raise DataError(str(path), UNREADABLE_FILE, f"{type(exc).__name__}: {exc}") from exc


def read_rows(args: DataArguments, report: LoadReport) -> Iterator[RawRow]:
    """Every raw row of the configured source, in a fixed order; records the files in `report`."""
    dataset = report.dataset
    if is_hub_id(dataset):
        report.files.append(f"{dataset}[{args.dataset_subset or ''}/{args.dataset_split}]")
        yield from read_hub(dataset, args.dataset_split, args.dataset_subset)
        return
    for path in data_files(Path(dataset).expanduser()):
        report.files.append(str(path))
        yield from read_file(path)


# --- which rows are usable ----------------------------------------------------------------------

def split_dialogue(text: str, source: str, which: str) -> tuple[str, str]:
    """(prompt up to and including the last "\\n\\nAssistant:", completion after it)."""
    cut = text.rfind(ASSISTANT)
    if cut < 0:
        raise DataError(source, NO_ASSISTANT_TURN, f"'{which}' has no {ASSISTANT!r} turn")
    cut += len(ASSISTANT)
    return text[:cut], text[cut:]


def decode_record(row: RawRow) -> dict:
    """The row as a mapping: a JSON line parsed, a parquet / hub record as it is; or the reason it is none."""
    record = row.value
    if isinstance(record, bytes):
        raise DataError(row.source, NOT_UTF8, "line is not UTF-8 text")
    if isinstance(record, str):
        line = record
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(row.source, NOT_JSON, f"line is not JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise DataError(row.source, NOT_JSON, "line nests arrays or objects too deeply to read") from None
        except ValueError as exc:  # an integer longer than Python converts (sys.get_int_max_str_digits)
            raise DataError(row.source, NOT_JSON, f"line cannot be read ({str(exc).split(';')[0]})") from None
        if SURROGATE_ESCAPE.search(line):
            check_text(record, row.source)
    if not isinstance(record, dict):
        raise DataError(row.source, NOT_OBJECT, f"expected a JSON object, got {type(record).__name__}")
    return record


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \uD800-\uDFFF: JSON's only way to spell a surrogate


def check_text(value: Any, source: str) -> None:
    """Every string in a decoded JSON value is Unicode text: a `\\ud800` escape with no partner decodes to a
    lone surrogate, which no tokenizer or UTF-8 writer takes. Walked without recursion: values nest deeply."""
    stack = [("line", value)]
    if isinstance(value, dict):
        stack = [(key, item) for key, v in reversed(value.items()) for item in (v, key)]
    while stack:  # (top-level field, a value inside it), first field first
        key, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((key, v) for pair in reversed(item.items()) for v in reversed(pair))
        elif isinstance(item, list):
            stack.extend((key, v) for v in reversed(item))
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise DataError(source, NOT_UTF8, f"{key!r} holds an unpaired surrogate ({item[exc.start]!r}), "
                                "which is not UTF-8 text") from None


def require_strings(record: dict, source: str, keys: Iterable[str]) -> None:
    """Each of `keys` is present, not null, and a string; else the first that is not, as a `DataError`."""
    for key in keys:
        if key not in record:
            raise DataError(source, MISSING_FIELD, f"no '{key}' field (keys: {sorted(record)})")
        if record[key] is None:
            raise DataError(source, MISSING_FIELD, f"'{key}' is null")
        if not isinstance(record[key], str):
            raise DataError(source, NOT_STRING, f"'{key}' is {type(record[key]).__name__}, not a string")


def parse_row(row: RawRow) -> PreferencePair:
    """Validate one raw row into a pair, or raise `DataError` with the first reason it fails."""
    record = decode_record(row)
    require_strings(record, row.source, ("chosen", "rejected"))
    prompt, chosen = split_dialogue(record["chosen"], row.source, "chosen")
    rejected_prompt, rejected = split_dialogue(record["rejected"], row.source, "rejected")
    if prompt != rejected_prompt:
        raise DataError(row.source, PROMPT_MISMATCH, "'chosen' and 'rejected' differ before their last Assistant turn")
    for key, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion.strip():
            raise DataError(row.source, EMPTY_COMPLETION, f"the last Assistant turn of '{key}' is empty")
    if chosen == rejected:
        raise DataError(row.source, IDENTICAL, "'chosen' and 'rejected' are the same text")
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, source=row.source)


def apply_policy(error: DataError, on_bad_row: str, skipped: Counter) -> None:
    """Raise under "error"; count under "skip". Shared by loading and tokenization."""
    if on_bad_row == "error":
        raise DataError(error.source, error.reason, error.detail + " (on_bad_row='skip' drops such rows)") from None
    skipped[error.reason] += 1
    logger.debug("skipping %s", error)


def validate_rows(rows: Iterable[RawRow], on_bad_row: str, report: LoadReport, limit: int = 0,
                  parse: Callable[[RawRow], PreferencePair] = parse_row) -> list[PreferencePair]:
    """The usable pairs of `rows` (the first `limit` of them, if set) through `parse` (hh-rlhf rows by
    default; `trainer.data.formats.parser_for` reads the other formats); bad ones raise or are counted in
    `report` per `on_bad_row`, so the counts cover exactly the rows read."""
    pairs = []
    for row in rows:
        if limit and len(pairs) >= limit:
            break
        report.rows_read += 1
        try:
            pairs.append(parse(row))
        except DataError as error:
            apply_policy(error, on_bad_row, report.skipped)
    report.kept = len(pairs)
    return pairs


def load_pairs(args: DataArguments, limit: int = 0,
               parse: Callable[[RawRow], PreferencePair] = parse_row) -> tuple[list[PreferencePair], LoadReport]:
    """Read and validate the rows of `args.dataset` (only until `limit` usable pairs, if set); logs and
    returns what was kept and dropped."""
    report = LoadReport(dataset=resolve_dataset(args.dataset))
    if args.dataset == "auto":
        logger.info("dataset 'auto' resolved to %s", report.dataset)
    pairs = validate_rows(read_rows(args, report), args.on_bad_row, report, limit, parse)
    if report.rows_read == 0:
        raise DataError(report.dataset, "empty", "the source holds no rows")
    logger.log(logging.WARNING if report.skipped else logging.INFO, "%s", report.summary())
    return pairs, report


# --- prompt-disjoint stage subsets --------------------------------------------------------------

@dataclass
class Splits:
    """Prompt-disjoint subsets. `sft` uses prompt + chosen; `ppo` holds one pair per prompt.

    `scale` is 1.0 when the data covered every requested size, else the factor the sft / reward /
    ppo sizes were scaled down by. `prompts` counts the distinct prompts, `eval_prompts` those eval took.
    """

    eval: list[PreferencePair]
    sft: list[PreferencePair]
    reward: list[PreferencePair]
    ppo: list[PreferencePair]
    scale: float = 1.0
    prompts: int = 0
    eval_prompts: int = 0

    def sizes(self) -> dict[str, int]:
        return {"eval": len(self.eval), "sft": len(self.sft), "reward": len(self.reward), "ppo": len(self.ppo)}


def group_by_prompt(pairs: Iterable[PreferencePair], seed: int) -> list[list[PreferencePair]]:
    """Pairs grouped by prompt, groups in a seeded order that does not depend on the input order."""
    groups: dict[str, list[PreferencePair]] = {}
    for pair in pairs:  # text rows (no prompt) are each a group of their own
        groups.setdefault(pair.prompt or "\0text\0" + pair.chosen, []).append(pair)
    # Sorting first makes the shuffle see the same sequence whatever file order or format the rows had.
    ordered = [sorted(g, key=lambda p: (p.chosen or "", p.rejected or "", p.source)) for _, g in sorted(groups.items())]
    random.Random(seed).shuffle(ordered)
    return ordered


def take_pairs(groups: list[list[PreferencePair]], start: int, count: int) -> tuple[list[PreferencePair], int]:
    """Whole groups from `start` until `count` pairs; the last group is cut to fit (its rest is unused,
    since its prompt now belongs to this subset). Returns the pairs and the next group index."""
    taken: list[PreferencePair] = []
    i = start
    while len(taken) < count and i < len(groups):
        taken.extend(groups[i][: count - len(taken)])
        i += 1
    return taken, i


def split_pairs(pairs: list[PreferencePair], args: DataArguments) -> Splits:
    """Deterministic prompt-disjoint subsets: eval first at its exact size, then sft, reward and ppo,
    scaled down together (proportionally) when the rest of the data cannot cover them."""
    groups = group_by_prompt(pairs, args.split_seed)
    eval_pairs, next_group = take_pairs(groups, 0, args.eval_size)
    eval_groups = next_group
    if len(eval_pairs) < args.eval_size:
        logger.warning("eval_size=%d but only %d pairs exist: eval takes them all", args.eval_size, len(eval_pairs))
    rest = sum(len(g) for g in groups[next_group:])
    requested = args.sft_size + args.reward_size + args.ppo_size
    scale = min(1.0, rest / requested) if requested else 1.0
    sft_size, reward_size, ppo_size = (int(n * scale) for n in (args.sft_size, args.reward_size, args.ppo_size))
    if scale < 1.0:
        logger.warning(
            "the data capped the subsets: %d pairs remain after eval for sft=%d + reward=%d + ppo=%d requested; "
            "scaled by %.3f to sft=%d, reward=%d, ppo=%d",
            rest, args.sft_size, args.reward_size, args.ppo_size, scale, sft_size, reward_size, ppo_size,
        )
    sft, next_group = take_pairs(groups, next_group, sft_size)
    reward, next_group = take_pairs(groups, next_group, reward_size)
    ppo = [g[0] for g in groups[next_group : next_group + ppo_size]]
    splits = Splits(eval=eval_pairs, sft=sft, reward=reward, ppo=ppo, scale=scale, prompts=len(groups),
                    eval_prompts=eval_groups)
    logger.info("split %d prompts (seed %d) into %s", len(groups), args.split_seed, splits.sizes())
    return splits


def load_splits(args: DataArguments, parse: Callable[[RawRow], PreferencePair] = parse_row
                ) -> tuple[Splits, LoadReport]:
    """Load, validate and split in one call: what the stage scripts use."""
    pairs, report = load_pairs(args, parse=parse)
    return split_pairs(pairs, args), report

