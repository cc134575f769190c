"""Preference rows in the formats users bring, each turned into the one `PreferencePair` every stage reads.

Detected per row from its columns, or forced with `--data_format`: `hh` (hh-rlhf's chosen / rejected
dialogues), and TRL's `preference`, `prompt_completion`, `prompt_only`, `text` and `conversational` rows.
A row's other columns (`answer`, ...) go with it to PPO's and GRPO's reward functions. A row a stage
cannot use (no rejected completion, no prompt, no completion) is a bad row with that reason. Conversational
rows are rendered to text by a `ChatRenderer` (the tokenizer's chat template, a Jinja file, or hh-rlhf's plain turns);
the completion is what the full conversation adds to the prompt, so the loss covers the assistant's turn.
A template file that fails stops the run with one line naming it: the file is at fault, not the row.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from foundation.cli import InputError
from trainer.data.hh_rlhf import (
    EMPTY_COMPLETION, IDENTICAL, MISSING_FIELD, NO_PROMPT, PROMPT_MISMATCH, DataError, PreferencePair, RawRow,
    decode_record, parse_row, require_strings,
)

logger = logging.getLogger(__name__)

NOT_MESSAGES = "not_messages"
WRONG_FORMAT = "wrong_format"
TEMPLATE_MISMATCH = "template_mismatch"
ROLES = ("system", "user", "assistant")
PLAIN_ROLES = {"system": "System", "user": "Human", "assistant": "Assistant"}
COMPLETIONS = ("chosen", "rejected", "completion", "text")  # a row's columns that are not handed on with it


class ChatTemplateError(InputError):
    """A `--chat_template` file that cannot render rows: the file is at fault, so no row is skipped for it."""


def load_template_file(path: str):
    """The Jinja template in `path`, compiled in a sandbox as transformers' chat templates are (the same
    `raise_exception`, `tojson` and `strftime_now`, trimmed blocks) but with undefined names raising instead
    of rendering as empty text, so a misspelt variable stops the run rather than silently changing every row.
    An undefined name still tests false (`{% if enable_thinking %}`), as templates use optional settings."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{path}: the chat template is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ChatTemplateError(f"{path}: the chat template cannot be read ({exc.strerror or exc})") from None
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, undefined=_PrintedUndefined,
                          extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{path}: the chat template is not valid Jinja at line {exc.lineno} "
                                f"({one_line(exc.message)})") from None


MAX_RENDERED = 1_000_000  # characters a chat template may render for one row: far past any context window


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with `str * n` and `list * n` refused past MAX_RENDERED items before they are built."""

    intercepted_binops = frozenset({"*"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                repeated = isinstance(items, (str, list, tuple)) and isinstance(times, int)
                if repeated and len(items) * times > MAX_RENDERED:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(items) * times:,} items is past the "
                                                          f"limit of {MAX_RENDERED:,}")
        return super().call_binop(context, operator, left, right)


class _PrintedUndefined(jinja2.StrictUndefined):
    """Raises when printed, iterated or compared, but is false in a test."""

    def __bool__(self) -> bool:
        return False


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers of some templates) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatRenderer:
    """Messages -> (prompt text, completion text), by a chat template or hh-rlhf's plain turns."""

    def __init__(self, tokenizer=None, chat_template: str = "auto"):
        self.tokenizer, self.path, self.template = tokenizer, None, None
        if chat_template not in ("auto", "none"):
            self.path, self.template = chat_template, load_template_file(chat_template)
        self.plain = chat_template == "none" or (self.template is None and (
            tokenizer is None or not getattr(tokenizer, "chat_template", None)))
        if chat_template == "auto" and self.plain and tokenizer is not None:
            logger.info("the tokenizer has no chat template: conversational rows are rendered as hh-rlhf turns")

    def render(self, messages: list[dict], add_generation_prompt: bool, source: str) -> str:
        if self.template is None:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        tokens = getattr(self.tokenizer, "special_tokens_map", None) or {}
        try:
            parts, size = [], 0
            for part in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=None, documents=None, **tokens):
                size += len(part)
                if size > MAX_RENDERED:
                    raise jinja2.exceptions.SecurityError(f"it renders more than {MAX_RENDERED:,} characters")
                parts.append(part)
            return "".join(parts)
        except Exception as exc:  # the template's own code failed: raise_exception, undefined, sandbox, any other
            raise ChatTemplateError(f"{self.path}: the chat template failed on {source}: {type(exc).__name__}: "
                                    f"{one_line(exc)}") from None

    def prompt(self, prompt: list[dict], source: str) -> str:
        """The prompt messages as the text a response follows (with the generation prompt)."""
        if self.plain:
            return "".join(f"\n\n{PLAIN_ROLES[m['role']]}: {m['content']}" for m in prompt) + "\n\nAssistant:"
        return self.render(prompt, True, source)

    def __call__(self, prompt: list[dict], completion: list[dict], source: str) -> tuple[str, str]:
        if self.plain:
            return self.prompt(prompt, source), "".join(
                f" {m['content']}" if i == 0 else f"\n\n{PLAIN_ROLES[m['role']]}: {m['content']}"
                for i, m in enumerate(completion))
        head = self.prompt(prompt, source)
        full = self.render(prompt + completion, False, source)
        if not full.startswith(head):
            raise DataError(source, TEMPLATE_MISMATCH, "the chat template renders the prompt differently inside the "
                            "full conversation, so the assistant's turn cannot be cut out exactly")
        tail = full[len(head):].rstrip()
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and tail.endswith(eos):  # tokenization appends EOS to every completion
            tail = tail[: -len(eos)]
        return head, tail


def detect(record: dict) -> str:
    """The format of one decoded row, from its columns."""
    if "completion" in record:
        return "prompt_completion"
    if "text" in record and "chosen" not in record:
        return "text"
    if "prompt" in record and "chosen" not in record and "rejected" not in record:
        return "prompt_only"
    if isinstance(record.get("chosen"), list) or isinstance(record.get("prompt"), list):
        return "conversational"
    return "preference" if "prompt" in record else "hh"


def _messages(value: Any, source: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(source, NOT_MESSAGES, f"'{key}' is not a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(source, NOT_MESSAGES, f"'{key}'[{i}] is not a {{'role': {'|'.join(ROLES)}, "
                            "'content': str} message")
    return value


def _pair(prompt: str, chosen: str, rejected: Optional[str], source: str) -> PreferencePair:
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        if text is not None and not text.strip():
            raise DataError(source, EMPTY_COMPLETION, f"the '{key}' completion is empty")
    if chosen == rejected:
        raise DataError(source, IDENTICAL, "'chosen' and 'rejected' are the same text")
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, source=source)


def parse_conversational(record: dict, source: str, render: ChatRenderer) -> PreferencePair:
    for key in ("chosen", "rejected"):
        if key not in record or record[key] is None:
            raise DataError(source, MISSING_FIELD, f"no '{key}' field (keys: {sorted(record)})")
    chosen, rejected = _messages(record["chosen"], source, "chosen"), _messages(record["rejected"], source, "rejected")
    if "prompt" in record:
        prompt = _messages(record["prompt"], source, "prompt")
    else:  # implicit prompt: everything before the final assistant message, the same in both
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        if prompt != record["rejected"][:-1]:
            raise DataError(source, PROMPT_MISMATCH, "'chosen' and 'rejected' differ before their last message")
        if not prompt:
            raise DataError(source, NOT_MESSAGES, "no prompt: 'chosen' holds one message")
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            raise DataError(source, NOT_MESSAGES, f"'{key}' does not end with an assistant message")
    head, chosen_text = render(prompt, chosen, source)
    _, rejected_text = render(prompt, rejected, source)
    return _pair(head, chosen_text, rejected_text, source)


def parse_prompt_completion(record: dict, source: str, render: ChatRenderer) -> PreferencePair:
    if "prompt" not in record:
        raise DataError(source, MISSING_FIELD, f"no 'prompt' field (keys: {sorted(record)})")
    if isinstance(record["prompt"], list) or isinstance(record["completion"], list):
        prompt = _messages(record["prompt"], source, "prompt")
        completion = _messages(record["completion"], source, "completion")
        if completion[-1]["role"] != "assistant":
            raise DataError(source, NOT_MESSAGES, "'completion' does not end with an assistant message")
        head, text = render(prompt, completion, source)
        return _pair(head, text, None, source)
    require_strings(record, source, ("prompt", "completion"))
    return _pair(record["prompt"], record["completion"], None, source)


def parse_prompt_only(record: dict, source: str, render: ChatRenderer) -> PreferencePair:
    """A prompt (text, or messages rendered with the generation prompt) and no completion: PPO and GRPO only."""
    if isinstance(record["prompt"], list):
        prompt = render.prompt(_messages(record["prompt"], source, "prompt"), source)
    else:
        require_strings(record, source, ("prompt",))
        prompt = record["prompt"]
    if not prompt.strip():
        raise DataError(source, NO_PROMPT, "'prompt' is empty")
    return PreferencePair(prompt=prompt, chosen=None, rejected=None, source=source)


def row_parser(data_format: str = "auto", render: Optional[ChatRenderer] = None) -> Callable[[RawRow], PreferencePair]:
    """The function that turns one raw row into a pair (or raises `DataError` with the reason)."""
    render = render or ChatRenderer()

    def parse(row: RawRow) -> PreferencePair:
        if data_format == "hh":  # the original path, untouched (including its own messages)
            return parse_row(row)
        record = decode_record(row)
        found = detect(record)
        if data_format != "auto" and found != data_format:
            raise DataError(row.source, WRONG_FORMAT, f"a {found} row (keys: {sorted(record)}), and --data_format "
                            f"is {data_format}")
        if found == "hh":
            return parse_row(RawRow(row.source, record))  # the decoded mapping: not parsed twice
        columns = {key: value for key, value in record.items() if key not in COMPLETIONS}
        return replace(parse_record(found, record, row.source), columns=columns)

    def parse_record(found: str, record: dict, source: str) -> PreferencePair:
        if found == "preference":
            require_strings(record, source, ("prompt", "chosen", "rejected"))
            return _pair(record["prompt"], record["chosen"], record["rejected"], source)
        if found == "text":
            require_strings(record, source, ("text",))
            if not record["text"].strip():
                raise DataError(source, EMPTY_COMPLETION, "'text' is empty")
            return PreferencePair(prompt="", chosen=record["text"], rejected=None, source=source)
        if found == "prompt_completion":
            return parse_prompt_completion(record, source, render)
        if found == "prompt_only":
            return parse_prompt_only(record, source, render)
        return parse_conversational(record, source, render)

    return parse


def parser_for(args, tokenizer=None) -> Callable[[RawRow], PreferencePair]:
    """The row parser of `args` (DataArguments: data_format, chat_template) with the run's tokenizer."""
    return row_parser(args.data_format, ChatRenderer(tokenizer, args.chat_template))
