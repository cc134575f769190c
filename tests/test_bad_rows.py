"""Bad rows stay bad rows: a row that Python's JSON reader or a tokenizer cannot take is counted under
`--on_bad_row skip` (and named under `error`), never the end of a run; a chat template file, a split that
runs out of prompts, and a few path and seed flags each end the command with one line that names the cause.

Stage commands run in this process through `foundation.cli.run`, the wrapper every entry point goes through.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from foundation.cli import run
from foundation.settings import DataArguments
from trainer.data.formats import ChatRenderer, row_parser
from trainer.data.hh_rlhf import DataError, RawRow, load_pairs

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
LONE_SURROGATE = (r'{"chosen": "\n\nHuman: Hi \ud800\n\nAssistant: Hello", '
                  r'"rejected": "\n\nHuman: Hi \ud800\n\nAssistant: No"}')
DEEP = "[" * 200_000 + "]" * 200_000
HUGE_INT = '{"chosen": ' + "7" * 5000 + ', "rejected": "No."}'
CHAT_ROW = {"prompt": [{"role": "user", "content": "How do I bake bread?"}],
            "chosen": [{"role": "assistant", "content": "Mix flour, water and yeast, then bake it."}],
            "rejected": [{"role": "assistant", "content": "No."}]}


def hh_row(i: int) -> dict:
    return {"chosen": f"\n\nHuman: Question {i} about bread?\n\nAssistant: Mix flour and yeast, {i} times.",
            "rejected": f"\n\nHuman: Question {i} about bread?\n\nAssistant: No."}


def rows_file(path: Path, lines: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    return path


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading a base model fails the test: each of these inputs must stop the command before one."""
    import trainer.model.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was caught")

    monkeypatch.setattr(loading, "load_base_model", refuse)


def one_line_error(module: str, argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, the one `error: ` line) of an entry point; fails on a traceback or several lines."""
    with pytest.raises(SystemExit) as exit_info:
        run(importlib.import_module(module).main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return exit_info.value.code, lines[0]


def sft(tmp_path: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY_SFT), "--output_dir", str(tmp_path / "run"), *extra]


# --- rows Python's JSON reader or a tokenizer cannot take ---------------------------------------

@pytest.mark.parametrize("line, reason, detail", [
    (LONE_SURROGATE, "not_utf8", r"'chosen' holds an unpaired surrogate ('\ud800'), which is not UTF-8 text"),
    (DEEP, "not_json", "line nests arrays or objects too deeply to read"),
    (HUGE_INT, "not_json", "Exceeds the limit (4300 digits) for integer string conversion"),
], ids=["lone surrogate", "200000-deep nesting", "5000-digit integer"])
def test_an_unreadable_json_row_is_counted_under_skip_and_named_under_error(line, reason, detail, tmp_path):
    path = rows_file(tmp_path / "rows.jsonl", [hh_row(0), line, hh_row(1)])
    for parse in (None, row_parser()):  # the hh-rlhf parser, and the one every format goes through
        kwargs = {"parse": parse} if parse else {}
        pairs, report = load_pairs(DataArguments(dataset=str(path)), **kwargs)
        assert len(pairs) == 2 and report.rows_read == 3 and report.skipped == {reason: 1}
        with pytest.raises(DataError) as error:
            load_pairs(DataArguments(dataset=str(path), on_bad_row="error"), **kwargs)
        assert str(error.value).startswith(f"{path}:2: {reason}: ") and detail in str(error.value)


def test_a_lone_surrogate_row_is_one_line_naming_the_row_under_error(tmp_path, capsys, no_model_loading,
                                                                     fresh_accelerate_state):
    path = rows_file(tmp_path / "rows.jsonl", [hh_row(i) for i in range(30)] + [LONE_SURROGATE])
    code, line = one_line_error("trainer.sft", sft(tmp_path, "--dataset", str(path), "--on_bad_row", "error"), capsys)
    assert code == 1 and line.startswith(f"error: {path}:31: not_utf8: 'chosen' holds an unpaired surrogate")


# --- chat template files ------------------------------------------------------------------------

TEMPLATES = {  # name -> (file bytes, what the one line says after the file's path)
    "raises": (b"{{ raise_exception('roles must alternate') }}",
               "the chat template failed on {data}:1: TemplateError: roles must alternate"),
    "syntax error": (b"{% for m in messages %}{{ m.content }",
                     "the chat template is not valid Jinja at line 1 (unexpected '}')"),
    "undefined variable": (b"{% for m in messages %}{{ m.content }}{{ end_of_turn }}{% endfor %}",
                           "the chat template failed on {data}:1: UndefinedError: 'end_of_turn' is undefined"),
    "not UTF-8": (b"{% for m in messages %}{{ m.content }}{% endfor %} caf\xe9",
                  "the chat template is not UTF-8 text (byte 54)"),
    "sandbox": (b"{{ messages.append(1) }}",
                "the chat template failed on {data}:1: SecurityError: access to attribute 'append' of 'list' object "
                "is unsafe."),
    # a template that would build gigabytes (issue 44: OOM-killed at 19.5 GB) stops before it does
    "a huge repetition": (b"{{ 'x' * 100000000 }}",
                          "the chat template failed on {data}:1: SecurityError: a repetition of 100,000,000 items is "
                          "past the limit of 1,000,000"),
    "a huge rendering": (b"{% for i in range(100000) %}{{ messages[0].content * 20 }}{% endfor %}",
                         "the chat template failed on {data}:1: SecurityError: it renders more than 1,000,000 "
                         "characters"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_broken_chat_template_file_is_one_line_naming_the_file(name, tmp_path, capsys, no_model_loading,
                                                                 fresh_accelerate_state):
    content, text = TEMPLATES[name]
    template = tmp_path / "chat.jinja"
    template.write_bytes(content)
    data = rows_file(tmp_path / "chat.jsonl", [CHAT_ROW] * 40)
    for policy in ("skip", "error"):  # the file is at fault, not a row: never skipped
        code, line = one_line_error("trainer.sft", sft(tmp_path, "--dataset", str(data), "--chat_template",
                                                       str(template), "--on_bad_row", policy), capsys)
        assert code == 1 and line == f"error: {template}: {text.replace('{data}', str(data))}"


def test_a_template_file_renders_rows_exactly_as_the_tokenizer_renders_the_same_template(smol_tokenizer, tmp_path):
    template = tmp_path / "smollm2.jinja"
    template.write_text(smol_tokenizer.chat_template)
    record = RawRow("chat.jsonl:1", json.dumps({**CHAT_ROW, "prompt": [{"role": "system", "content": "Be brief."},
                                                                        *CHAT_ROW["prompt"]]}))
    from_file = row_parser("auto", ChatRenderer(smol_tokenizer, str(template)))(record)
    from_tokenizer = row_parser("auto", ChatRenderer(smol_tokenizer, "auto"))(record)
    assert from_file == from_tokenizer
    assert from_file.prompt.endswith("<|im_start|>assistant\n") and from_file.chosen == CHAT_ROW["chosen"][0]["content"]


def test_an_optional_setting_a_template_tests_for_may_be_left_undefined(smol_tokenizer, tmp_path):
    template = tmp_path / "optional.jinja"
    template.write_text("{% for m in messages %}{% if enable_thinking %}<think>{% endif %}{{ m.content }}\n"
                        "{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
    rendered = ChatRenderer(smol_tokenizer, str(template)).render(CHAT_ROW["prompt"], True, "chat.jsonl:1")
    assert rendered == CHAT_ROW["prompt"][0]["content"] + "\nA: "


# --- a split with too few prompts, and flags ----------------------------------------------------

def test_rows_sharing_one_prompt_stop_with_the_split_named_not_skipped_rows(tmp_path, capsys, no_model_loading,
                                                                            fresh_accelerate_state):
    row = hh_row(0)
    path = rows_file(tmp_path / "one_prompt.jsonl",
                     [{"chosen": row["chosen"] + f" Variant {i}.", "rejected": row["rejected"]} for i in range(200)])
    code, line = one_line_error("trainer.sft", sft(tmp_path, "--dataset", str(path)), capsys)
    assert code == 1 and "skipped" not in line
    assert line == (f"error: {path}: the prompt-disjoint split left too few prompts for sft: 1 distinct prompt(s) in "
                    "200 usable pairs, eval took 1, leaving 0 sft rows where one batch needs 4; use data with more "
                    "distinct prompts or a smaller --eval_size")


FLAG_CASES = {  # name -> (module, argv, the one line after "error: "), with {file}, {folder}, {tmp} filled in
    "seed -1": ("trainer.sft", ["--config", str(TINY_SFT), "--output_dir", "{tmp}/run", "--seed", "-1"],
                "--seed -1: must be in [0, 4294967295]"),
    "evaluate: output_file a folder": (
        "trainer.evaluate", ["sft", "--adapter", "{tmp}/adapter", "--data", "{file}", "--output_file", "{folder}"],
        "--output_file '{folder}': is a folder; name a JSON file (e.g. {folder}/evaluation.json)"),
    "pipeline: run_dir a file": ("trainer.pipeline", ["--run_dir", "{file}"],
                                 "--run_dir '{file}': is a file; name a folder"),
    "pipeline: run_dir under a file": ("trainer.pipeline", ["--run_dir", "{file}/run"],
                                       "--run_dir '{file}/run': lies under {file}, which is a file; name a folder"),
    "compare: run_dir a file": ("trainer.compare", ["--run_dir", "{file}"],
                                "--run_dir '{file}': is a file; name a folder"),
}


@pytest.mark.parametrize("name", list(FLAG_CASES))
def test_a_negative_seed_a_folder_output_file_and_a_file_run_dir_are_one_line_each(name, tmp_path, capsys,
                                                                                  no_model_loading,
                                                                                  fresh_accelerate_state):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    paths = {"{file}": str(tmp_path / "a-file"), "{folder}": str(tmp_path / "a-folder"), "{tmp}": str(tmp_path)}

    def fill(text: str) -> str:
        for key, value in paths.items():
            text = text.replace(key, value)
        return text

    module, argv, text = FLAG_CASES[name]
    assert one_line_error(module, [fill(a) for a in argv], capsys) == (2, f"error: {fill(text)}")
