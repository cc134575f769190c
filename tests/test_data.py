"""The hh-rlhf pipeline on real rows: loading, bad-row policy, prompt split, subsets, tokens, batches."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import trainer.data.hh_rlhf as data
from foundation.cli import UsageError
from foundation.settings import DATA_ENV, HUB_DATASET, DataArguments
from trainer.data.collators import PairCollator, PromptCollator, SFTCollator
from trainer.data.hh_rlhf import ASSISTANT, DataError, PreferencePair, load_pairs, load_splits, split_pairs
from trainer.data.tokenization import (
    IGNORE_INDEX, PairExample, PromptExample, SFTExample, fit_prompt, tokenize_pairs, tokenize_prompts, tokenize_sft,
)

N_LINES = 50
BAD_LINE = 8  # 1-based line that each defect replaces


# --- fixtures: real rows copied into tmp_path ----------------------------------------------------

@pytest.fixture(scope="session")
def real_lines(shared_data) -> list[str]:
    """The first 50 lines of a real file (all 50 are well formed, see the clean-copy test)."""
    with gzip.open(shared_data / "harmless-base" / "test.jsonl.gz", "rt", encoding="utf-8") as f:
        return [next(f) for _ in range(N_LINES)]


@pytest.fixture(scope="session")
def real_pairs(shared_data) -> list[PreferencePair]:
    pairs, _ = load_pairs(DataArguments(dataset=str(shared_data)))
    return pairs


def write_jsonl(path: Path, lines: list[str]) -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in lines)
    return path


def write_parquet(path: Path, lines: list[str]) -> Path:
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines]), path)
    return path


def args_for(path, **overrides) -> DataArguments:
    return DataArguments(dataset=str(path), **overrides)


def without_source(pairs):
    return [(p.prompt, p.chosen, p.rejected) for p in pairs]


def edit_record(edit):
    """A defect that rewrites the parsed record of a line."""
    def apply(line: str) -> str:
        record = json.loads(line)
        edit(record)
        return json.dumps(record)
    return apply


def prompt_of(record: dict) -> str:
    return record["chosen"][: record["chosen"].rfind(ASSISTANT) + len(ASSISTANT)]


DEFECTS = {
    data.NOT_JSON: lambda line: line[: len(line) // 2],  # a line cut off mid-record
    data.NOT_OBJECT: lambda line: json.dumps([json.loads(line)["chosen"], json.loads(line)["rejected"]]),
    data.MISSING_FIELD: edit_record(lambda r: r.pop("chosen")),
    data.NOT_STRING: edit_record(lambda r: r.update(rejected=42)),
    data.NO_ASSISTANT_TURN: edit_record(lambda r: r.update(chosen=r["chosen"].replace(ASSISTANT, "\n\nAI:"))),
    data.PROMPT_MISMATCH: edit_record(lambda r: r.update(rejected="\n\nHuman: Hello?" + r["rejected"])),
    data.EMPTY_COMPLETION: edit_record(lambda r: r.update(rejected=prompt_of(r) + "  \n")),
    data.IDENTICAL: edit_record(lambda r: r.update(rejected=r["chosen"])),
}


def with_defect(lines: list[str], reason: str) -> list[str]:
    out = list(lines)
    out[BAD_LINE - 1] = DEFECTS[reason](out[BAD_LINE - 1])
    return out


# --- loading and the bad-row policy --------------------------------------------------------------

def test_clean_copy_of_real_lines_keeps_every_row(tmp_path, real_lines):
    path = write_jsonl(tmp_path / "clean.jsonl", real_lines)
    pairs, report = load_pairs(args_for(path, on_bad_row="error"))
    assert (report.rows_read, report.kept, dict(report.skipped)) == (N_LINES, N_LINES, {})
    assert [p.source for p in pairs] == [f"{path}:{i}" for i in range(1, N_LINES + 1)]


@pytest.mark.parametrize("reason", sorted(DEFECTS))
def test_bad_row_under_error_names_file_line_and_reason(tmp_path, real_lines, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", with_defect(real_lines, reason))
    with pytest.raises(DataError) as info:
        load_pairs(args_for(path, on_bad_row="error"))
    assert info.value.source == f"{path}:{BAD_LINE}"
    assert info.value.reason == reason
    assert str(info.value).startswith(f"{path}:{BAD_LINE}: {reason}: ")


@pytest.mark.parametrize("reason", sorted(DEFECTS))
def test_bad_row_under_skip_is_counted_once_by_reason(tmp_path, real_lines, reason, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", with_defect(real_lines, reason))
    with caplog.at_level(logging.INFO, logger="trainer.data.hh_rlhf"):
        pairs, report = load_pairs(args_for(path, on_bad_row="skip"))
    assert (report.rows_read, report.kept, dict(report.skipped)) == (N_LINES, N_LINES - 1, {reason: 1})
    assert f"{path}:{BAD_LINE}" not in {p.source for p in pairs}
    assert f"{reason}: 1" in caplog.text


def test_real_rows_split_at_last_assistant_turn(shared_data):
    pairs, report = load_pairs(DataArguments(dataset=str(shared_data), on_bad_row="skip"))
    # Found by reading all 7,415 rows: no row has more than one of these defects.
    assert report.rows_read == 7415
    assert dict(report.skipped) == {data.IDENTICAL: 34, data.PROMPT_MISMATCH: 17, data.EMPTY_COMPLETION: 8}
    assert report.kept == len(pairs) == 7415 - 59
    for pair in pairs:
        assert pair.prompt.startswith("\n\nHuman:") and pair.prompt.endswith(ASSISTANT)
        for completion in (pair.chosen, pair.rejected):
            assert completion.strip() and ASSISTANT not in completion
        assert pair.chosen != pair.rejected


@pytest.mark.parametrize("subset, line, reason", [
    ("harmless-base", 87, data.EMPTY_COMPLETION),
    ("helpful-base", 121, data.EMPTY_COMPLETION),
    ("helpful-rejection-sampled", 201, data.IDENTICAL),
])
def test_error_policy_stops_at_first_naturally_bad_real_row(shared_data, subset, line, reason):
    path = shared_data / subset / "test.jsonl.gz"
    with pytest.raises(DataError) as info:
        load_pairs(args_for(path, on_bad_row="error"))
    assert (info.value.source, info.value.reason) == (f"{path}:{line}", reason)


def test_jsonl_gzip_and_parquet_give_the_same_pairs(tmp_path, real_lines):
    loaded = {}
    for name, write in [("a.jsonl", write_jsonl), ("a.jsonl.gz", write_jsonl), ("a.parquet", write_parquet)]:
        pairs, report = load_pairs(args_for(write(tmp_path / name, real_lines + ["\n"] * (name == "a.jsonl"))))
        assert report.rows_read == N_LINES  # a blank line is not a row
        assert pairs[BAD_LINE - 1].source == f"{tmp_path / name}:{BAD_LINE}"
        loaded[name] = without_source(pairs)
    assert loaded["a.jsonl"] == loaded["a.jsonl.gz"] == loaded["a.parquet"]
    assert len(loaded["a.jsonl"]) == N_LINES


def test_parquet_null_field_is_a_counted_missing_field(tmp_path, real_lines):
    records = [json.loads(line) for line in real_lines]
    records[BAD_LINE - 1]["rejected"] = None
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    _, report = load_pairs(args_for(path))
    assert dict(report.skipped) == {data.MISSING_FIELD: 1}
    with pytest.raises(DataError, match=f"nulls.parquet:{BAD_LINE}: missing_field"):
        load_pairs(args_for(path, on_bad_row="error"))


def test_folder_is_read_recursively_in_sorted_path_order(tmp_path, real_lines):
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "deep").mkdir(parents=True)
    write_jsonl(tmp_path / "b" / "x.jsonl", real_lines[:10])
    write_parquet(tmp_path / "a" / "deep" / "y.parquet", real_lines[10:15])
    write_jsonl(tmp_path / "a" / "z.jsonl.gz", real_lines[15:20])
    (tmp_path / "a" / "notes.txt").write_text("not data")
    pairs, report = load_pairs(args_for(tmp_path))
    assert report.files == [str(tmp_path / "a" / "deep" / "y.parquet"), str(tmp_path / "a" / "z.jsonl.gz"),
                            str(tmp_path / "b" / "x.jsonl")]
    expected = [json.loads(line)["chosen"] for line in real_lines[10:20] + real_lines[:10]]
    assert [p.prompt + p.chosen for p in pairs] == expected


def test_missing_path_and_empty_folder_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nowhere'}: not_found"):
        load_pairs(args_for(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("no rows here")
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'}: no_data_files"):
        load_pairs(args_for(tmp_path / "empty"))
    with pytest.raises(DataError, match="unsupported_file"):
        load_pairs(args_for(tmp_path / "empty" / "readme.md"))
    write_jsonl(tmp_path / "blank.jsonl", ["\n"])
    with pytest.raises(DataError, match="blank.jsonl: empty"):
        load_pairs(args_for(tmp_path / "blank.jsonl"))


def test_corrupt_file_is_an_error_naming_it_even_under_skip(tmp_path, real_lines):
    whole = write_jsonl(tmp_path / "whole.jsonl.gz", real_lines).read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=f"{cut}: unreadable_file: EOFError"):
        load_pairs(args_for(cut, on_bad_row="skip"))
    fake = tmp_path / "fake.parquet"
    fake.write_text("\n".join(real_lines))
    with pytest.raises(DataError, match=f"{fake}: unreadable_file: ArrowInvalid"):
        load_pairs(args_for(fake, on_bad_row="skip"))


def test_corrupt_deflate_data_is_an_error_naming_the_file(tmp_path, real_lines):
    whole = write_jsonl(tmp_path / "whole.jsonl.gz", real_lines).read_bytes()
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(whole[:60] + bytes(b ^ 0x5A for b in whole[60:200]) + whole[200:])  # zlib.error inside
    with pytest.raises(DataError, match=f"{broken}: unreadable_file"):
        load_pairs(args_for(broken, on_bad_row="skip"))


def test_a_byte_order_mark_does_not_cost_the_first_row(tmp_path, real_lines):
    plain = write_jsonl(tmp_path / "plain.jsonl", real_lines)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    with_bom, report = load_pairs(args_for(bom))
    assert without_source(with_bom) == without_source(load_pairs(args_for(plain))[0])
    assert report.skipped == {}


def test_one_line_that_is_not_utf8_is_one_bad_row_not_a_bad_file(tmp_path, real_lines):
    path = tmp_path / "latin1.jsonl"
    lines = [line.encode("utf-8") for line in real_lines]
    lines[4] = b'{"chosen": "caf\xe9", "rejected": "x"}\n'  # Latin-1, invalid as UTF-8
    path.write_bytes(b"".join(lines))
    pairs, report = load_pairs(args_for(path))
    assert len(pairs) == len(real_lines) - 1 and report.skipped == {"not_utf8": 1}
    with pytest.raises(DataError, match=f"{path}:5: not_utf8"):
        load_pairs(args_for(path, on_bad_row="error"))


def test_a_null_field_is_reported_as_null(tmp_path, real_lines):
    record = json.loads(real_lines[0])
    record["rejected"] = None
    path = write_jsonl(tmp_path / "null.jsonl", [json.dumps(record)])
    with pytest.raises(DataError, match=f"{path}:1: missing_field: 'rejected' is null"):
        load_pairs(args_for(path, on_bad_row="error"))


def test_a_limit_counts_skips_only_among_the_rows_it_read(tmp_path, real_lines):
    lines = list(real_lines)
    lines[1] = "not json"
    lines[30] = "not json either"  # past the limit: neither read nor counted
    path = write_jsonl(tmp_path / "limited.jsonl", lines)
    pairs, report = load_pairs(args_for(path), limit=10)
    assert len(pairs) == 10 and report.rows_read == 11 and report.skipped == {"not_json": 1}


def test_unknown_bad_row_policy_is_rejected_before_reading(tmp_path):
    with pytest.raises(UsageError, match=r"--on_bad_row 'ignore': must be one of skip, error"):
        load_pairs(args_for(tmp_path / "never-read", on_bad_row="ignore"))


# --- the hub path and "auto" ---------------------------------------------------------------------

@pytest.fixture
def fake_hub(monkeypatch, real_lines):
    """`datasets.load_dataset` replaced by one that serves the real lines and records its calls."""
    import datasets

    calls = []

    def load_dataset(name, **kwargs):
        calls.append((name, kwargs))
        return datasets.Dataset.from_list([json.loads(line) for line in real_lines])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_dataset_is_loaded_through_datasets_load_dataset(fake_hub, tmp_path, real_lines):
    pairs, report = load_pairs(DataArguments(dataset=HUB_DATASET))
    assert fake_hub == [("Anthropic/hh-rlhf", {"data_dir": None, "split": "train"})]
    local, _ = load_pairs(args_for(write_jsonl(tmp_path / "a.jsonl", real_lines)))
    assert without_source(pairs) == without_source(local)
    assert pairs[0].source == "Anthropic/hh-rlhf[train]:1"
    assert report.files == [f"{HUB_DATASET}[/train]"]


def test_hub_subset_and_split_are_passed_on(fake_hub):
    pairs, _ = load_pairs(DataArguments(dataset=HUB_DATASET, dataset_subset="helpful-base", dataset_split="test"))
    assert fake_hub == [("Anthropic/hh-rlhf", {"data_dir": "helpful-base", "split": "test"})]
    assert pairs[BAD_LINE - 1].source == f"Anthropic/hh-rlhf[helpful-base/test]:{BAD_LINE}"


def test_auto_uses_env_folder_then_shared_folder_then_hub(fake_hub, monkeypatch, tmp_path, real_lines):
    write_jsonl(tmp_path / "mine.jsonl", real_lines[:5])
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    _, report = load_pairs(DataArguments(dataset="auto"))
    assert (report.dataset, report.rows_read, fake_hub) == (str(tmp_path), 5, [])

    monkeypatch.delenv(DATA_ENV)
    monkeypatch.setattr(data, "SHARED_DATA", tmp_path)
    assert load_pairs(DataArguments(dataset="auto"))[1].dataset == str(tmp_path)

    monkeypatch.setattr(data, "SHARED_DATA", tmp_path / "absent")
    _, report = load_pairs(DataArguments(dataset="auto"))
    assert (report.dataset, report.rows_read, len(fake_hub)) == (HUB_DATASET, N_LINES, 1)


def test_unreachable_hub_is_a_clear_error():
    # conftest sets HF_DATASETS_OFFLINE=1, so this is the real datasets code path failing.
    with pytest.raises(DataError, match="Anthropic/hh-rlhf: hub_unavailable: no such local file or folder"):
        load_pairs(DataArguments(dataset=HUB_DATASET))


# --- prompt-disjoint subsets ---------------------------------------------------------------------

def prompts_of(pairs) -> set[str]:
    return {p.prompt for p in pairs}


def assert_prompt_disjoint(splits):
    subsets = [prompts_of(splits.eval), prompts_of(splits.sft), prompts_of(splits.reward), prompts_of(splits.ppo)]
    assert sum(map(len, subsets)) == len(set().union(*subsets))


def test_splits_are_prompt_disjoint_and_sized_as_asked(real_pairs):
    args = DataArguments(eval_size=100, sft_size=1000, reward_size=2000, ppo_size=500)
    splits = split_pairs(real_pairs, args)
    assert splits.sizes() == {"eval": 100, "sft": 1000, "reward": 2000, "ppo": 500}
    assert splits.scale == 1.0
    assert_prompt_disjoint(splits)
    assert len(prompts_of(splits.ppo)) == 500  # ppo counts prompts, not pairs


def test_pairs_sharing_a_prompt_land_in_one_subset(real_pairs):
    # 40 prompts with 3 pairs each: a split that dealt pairs instead of prompts would leak.
    pairs = [dataclasses.replace(p, chosen=p.chosen + f" ({k})", source=f"{p.source}#{k}")
             for p in real_pairs[:40] for k in range(3)]
    splits = split_pairs(pairs, DataArguments(eval_size=10, sft_size=30, reward_size=30, ppo_size=5))
    assert_prompt_disjoint(splits)
    assert splits.sizes() == {"eval": 10, "sft": 30, "reward": 30, "ppo": 5}
    # eval's 10 pairs come from 4 prompts (3+3+3+1); the 4th prompt's other 2 pairs are in no subset.
    assert len(prompts_of(splits.eval)) == 4


def test_split_is_deterministic_order_free_and_seeded(real_pairs):
    args = DataArguments(eval_size=50, sft_size=300, reward_size=300, ppo_size=100, split_seed=7)
    first = split_pairs(real_pairs, args)
    assert split_pairs(list(reversed(real_pairs)), args) == first
    other = split_pairs(real_pairs, dataclasses.replace(args, split_seed=8))
    assert prompts_of(other.eval) != prompts_of(first.eval)
    assert other.sizes() == first.sizes()


def test_requests_beyond_the_data_are_scaled_down_proportionally(real_lines, tmp_path, caplog):
    pairs, _ = load_pairs(args_for(write_jsonl(tmp_path / "a.jsonl", real_lines)))
    assert len(prompts_of(pairs)) == N_LINES
    with caplog.at_level(logging.WARNING, logger="trainer.data.hh_rlhf"):
        splits = split_pairs(pairs, DataArguments(eval_size=10, sft_size=40, reward_size=20, ppo_size=20))
    assert splits.scale == 0.5  # 40 pairs left after eval, 80 requested
    assert splits.sizes() == {"eval": 10, "sft": 20, "reward": 10, "ppo": 10}
    assert "the data capped the subsets" in caplog.text
    assert_prompt_disjoint(splits)


def test_load_splits_reads_and_splits_in_one_call(tmp_path, real_lines):
    path = write_jsonl(tmp_path / "a.jsonl", with_defect(real_lines, data.IDENTICAL))
    splits, report = load_splits(args_for(path, eval_size=5, sft_size=10, reward_size=10, ppo_size=10))
    assert (report.kept, dict(report.skipped)) == (N_LINES - 1, {data.IDENTICAL: 1})
    assert splits.sizes() == {"eval": 5, "sft": 10, "reward": 10, "ppo": 10}


# --- tokenization --------------------------------------------------------------------------------

def ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def test_sft_labels_mask_exactly_the_prompt(smol_tokenizer, real_pairs):
    pairs = real_pairs[:50]
    examples, report = tokenize_sft(pairs, smol_tokenizer, DataArguments(max_length=4096))
    assert (report.kept, report.truncated, report.too_long) == (50, 0, 0)
    eos = smol_tokenizer.eos_token_id
    for pair, ex in zip(pairs, examples):
        prompt_ids, completion_ids = ids(smol_tokenizer, pair.prompt, True), ids(smol_tokenizer, pair.chosen, False)
        assert ex.input_ids == prompt_ids + completion_ids + [eos]
        assert ex.labels == [IGNORE_INDEX] * len(prompt_ids) + completion_ids + [eos]
        assert ex.source == pair.source


def test_sft_truncation_cuts_the_prompt_left_and_counts_exactly(smol_tokenizer, real_pairs):
    pairs, limit, floor = real_pairs[:300], 128, 8
    examples, report = tokenize_sft(pairs, smol_tokenizer, DataArguments(max_length=limit, min_prompt_tokens=floor))
    expected, n_truncated = {}, 0
    for pair in pairs:
        prompt_ids = ids(smol_tokenizer, pair.prompt, True)
        completion_ids = ids(smol_tokenizer, pair.chosen, False) + [smol_tokenizer.eos_token_id]
        budget = limit - len(completion_ids)
        if budget < floor:
            continue
        if len(prompt_ids) > budget:
            n_truncated += 1
            prompt_ids = prompt_ids[-budget:]
        expected[pair.source] = (prompt_ids, completion_ids)
    assert report.too_long == len(pairs) - len(expected) > 0
    assert report.truncated == n_truncated > 0
    assert {ex.source: (ex.prompt_ids, ex.completion_ids) for ex in examples} == expected
    assert all(len(ex.input_ids) <= limit for ex in examples)


def test_truncation_keeps_a_leading_bos(smol_tokenizer, real_pairs):
    class BosFirst:
        """The SmolLM2 tokenizer made to add a BOS, as Llama's does."""
        bos_token_id, eos_token_id = smol_tokenizer.bos_token_id, smol_tokenizer.eos_token_id

        def __call__(self, texts, add_special_tokens, verbose):
            out = smol_tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
            return {"input_ids": [[self.bos_token_id] * add_special_tokens + row for row in out]}

    pair = next(p for p in real_pairs if len(p.prompt) > 1000 and len(p.chosen) < 80)
    (ex,), report = tokenize_sft([pair], BosFirst(), DataArguments(max_length=64))
    full_prompt = ids(smol_tokenizer, pair.prompt, True)
    budget = 64 - len(ex.completion_ids)
    assert report.truncated == 1
    assert ex.prompt_ids == [smol_tokenizer.bos_token_id] + full_prompt[-(budget - 1):]
    assert fit_prompt([1, 5, 6, 7, 8, 9], 4, 2, bos_id=1) == [1, 7, 8, 9]
    assert fit_prompt([5, 6, 7, 8, 9], 4, 2, bos_id=1) == [6, 7, 8, 9]
    assert fit_prompt([5, 6, 7], 4, 2, bos_id=None) == [5, 6, 7]
    assert fit_prompt([5, 6, 7], 1, 2, bos_id=None) is None


def test_row_longer_than_max_length_is_too_long_at_tokenization(smol_tokenizer, tmp_path, real_lines):
    def long_chosen(r):
        r["chosen"] = prompt_of(r) + " I can help with that." * 200
    lines = list(real_lines)
    lines[BAD_LINE - 1] = edit_record(long_chosen)(lines[BAD_LINE - 1])
    path = write_jsonl(tmp_path / "long.jsonl", lines)
    pairs, load_report = load_pairs(args_for(path, on_bad_row="error"))
    assert load_report.kept == N_LINES  # length is not known until tokenization

    examples, report = tokenize_sft(pairs, smol_tokenizer, args_for(path, on_bad_row="skip"))
    assert (report.rows, report.kept, report.too_long) == (N_LINES, N_LINES - 1, 1)
    assert f"{path}:{BAD_LINE}" not in {ex.source for ex in examples}
    with pytest.raises(DataError) as info:
        tokenize_sft(pairs, smol_tokenizer, args_for(path, on_bad_row="error"))
    assert (info.value.source, info.value.reason) == (f"{path}:{BAD_LINE}", data.TOO_LONG)
    assert "max_length=512" in str(info.value)


def test_pair_examples_share_one_prompt_budgeted_by_the_longer_completion(smol_tokenizer, real_pairs):
    pairs, limit = real_pairs[:200], 160
    examples, report = tokenize_pairs(pairs, smol_tokenizer, DataArguments(max_length=limit))
    by_source = {p.source: p for p in pairs}
    truncated = 0
    for ex in examples:
        pair = by_source[ex.source]
        assert ex.chosen_ids == ids(smol_tokenizer, pair.chosen, False) + [smol_tokenizer.eos_token_id]
        assert ex.rejected_ids == ids(smol_tokenizer, pair.rejected, False) + [smol_tokenizer.eos_token_id]
        full_prompt = ids(smol_tokenizer, pair.prompt, True)
        longest = max(len(ex.chosen_ids), len(ex.rejected_ids))
        budget = limit - longest
        assert ex.prompt_ids == (full_prompt[-budget:] if len(full_prompt) > budget else full_prompt)
        truncated += len(ex.prompt_ids) < len(full_prompt)
        assert len(ex.prompt_ids) + longest <= limit
    assert report.truncated == truncated > 0
    assert report.kept + report.too_long == len(pairs) and report.too_long > 0


def test_ppo_prompts_are_left_truncated_to_max_prompt_length(smol_tokenizer, real_pairs):
    pairs = real_pairs[:100]
    examples, report = tokenize_prompts(pairs, smol_tokenizer, DataArguments(max_prompt_length=48))
    full = [ids(smol_tokenizer, p.prompt, True) for p in pairs]
    assert [ex.prompt_ids for ex in examples] == [f[-48:] for f in full]
    assert report.truncated == sum(len(f) > 48 for f in full) > 0
    assert report.kept == 100


def test_all_real_rows_tokenize_in_seconds(smol_tokenizer, real_pairs):
    examples, report = tokenize_pairs(real_pairs, smol_tokenizer, DataArguments(max_length=512))
    # Counted once with this tokenizer at max_length=512, min_prompt_tokens=8.
    assert (report.rows, report.kept, report.truncated, report.too_long) == (7356, 7349, 372, 7)


# --- collators -----------------------------------------------------------------------------------

def test_sft_collator_pads_right_with_masked_labels():
    batch = SFTCollator(pad_token_id=0)(
        [SFTExample([5, 6], [7, 2], "a"), SFTExample([5, 6, 8], [9, 9, 9, 2], "b")]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2, 0, 0, 0], [5, 6, 8, 9, 9, 9, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 2, -100, -100, -100],
                                        [-100, -100, -100, 9, 9, 9, 2]]
    assert batch["input_ids"].dtype == torch.long


def test_pair_collator_puts_chosen_rows_before_rejected_rows():
    batch = PairCollator(pad_token_id=0)(
        [PairExample([5], [6, 2], [7, 7, 2], "a"), PairExample([8, 8], [9, 2], [3, 2], "b")]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 2, 0], [8, 8, 9, 2], [5, 7, 7, 2], [8, 8, 3, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 2, -100], [-100, -100, 9, 2], [-100, 7, 7, 2], [-100, -100, 3, 2]]


def test_prompt_collator_pads_left_for_generation():
    batch = PromptCollator(pad_token_id=0)([PromptExample([5, 6, 7], "a"), PromptExample([8], "b")])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert set(batch) == {"input_ids", "attention_mask", "examples"}


def test_collators_batch_real_tokenized_rows(smol_tokenizer, real_pairs):
    args = DataArguments(max_length=256, max_prompt_length=64)
    pair_examples, _ = tokenize_pairs(real_pairs[:4], smol_tokenizer, args)
    batch = PairCollator(smol_tokenizer.pad_token_id)(pair_examples)
    lengths = [len(e.prompt_ids) + len(e.chosen_ids) for e in pair_examples]
    lengths += [len(e.prompt_ids) + len(e.rejected_ids) for e in pair_examples]
    assert batch["input_ids"].shape == (8, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    completion_tokens = sum(len(e.chosen_ids) + len(e.rejected_ids) for e in pair_examples)
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == completion_tokens

    prompts, _ = tokenize_prompts(real_pairs[:4], smol_tokenizer, args)
    generation = PromptCollator(smol_tokenizer.pad_token_id)(prompts)
    assert generation["attention_mask"][:, -1].tolist() == [1, 1, 1, 1]
    assert generation["input_ids"][0, -len(prompts[0].prompt_ids):].tolist() == prompts[0].prompt_ids


def test_empty_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="empty batch"):
        SFTCollator(pad_token_id=0)([])
