"""Every command line of the project parses through here: flags into argument dataclasses, each field
checked, and a mistake reported as one line.

An argument dataclass derives from `Checked` and states its field rules in `RULES` (`{"max_steps":
at_least(1), ...}`); field types are checked too, so a wrong YAML value is caught like a wrong flag, and
cross-field rules go in `check()`. `run(main)` wraps every entry point: a `UsageError` (exit 2) or an
`InputError` (exit 1) becomes one line on stderr from the first process, not a traceback.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import re
import sys
import typing
from dataclasses import fields, replace
from typing import Any, Callable, ClassVar, Optional, Sequence

NULL_WORDS = ("null", "None", "none", "~")
AUTO = "auto"  # the value of a field the budget planner may choose (a class's PLANNED) left to it
UNPLANNED = "unplanned"  # metadata of a planned true/false or number field: its value where nothing plans it


class UsageError(Exception):
    """Flags or a config file that cannot work; the message names the setting and what to use."""


class InputError(Exception):
    """A data, model, adapter or checkpoint file that cannot be used; the message names the file."""


class FieldError(UsageError):
    def __init__(self, name: str, value: Any, problem: str):
        self.name, self.value, self.problem = name, value, problem
        shown = repr(value)
        super().__init__(f"--{name} {shown if len(shown) <= 200 else shown[:200] + '...'}: {problem}")


# ---- rules ----------------------------------------------------------------------------------------

Rule = Callable[[str, Any], Optional[str]]  # (field name, value) -> what is wrong, or None


def at_least(low: float) -> Rule:
    return lambda name, value: None if value >= low else f"must be at least {low}"


def above(low: float) -> Rule:
    return lambda name, value: None if value > low else f"must be greater than {low}"


def between(low: float, high: float, high_open: bool = False) -> Rule:
    def rule(name, value):
        ok = low <= value < high if high_open else low <= value <= high
        return None if ok else f"must be in [{low}, {high}{')' if high_open else ']'}"
    return rule


def one_of(*choices: str) -> Rule:
    return lambda name, value: None if value in choices else f"must be one of {', '.join(map(str, choices))}"


def _unwrap_optional(hint) -> tuple[Any, bool]:
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _auto_or(hint) -> Optional[type]:
    """X of a planned field's `Union[X, str]` (X or auto), else None."""
    args = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else ()
    return args[0] if len(args) == 2 and args[1] is str and args[0] is not type(None) else None


def _check_type(name: str, hint, value):
    """`value` as the field's type (an int is a float too), or a FieldError."""
    planned_kind = _auto_or(hint)
    if planned_kind is not None:
        if value == AUTO:
            return value
        try:
            return _check_type(name, planned_kind, value)
        except FieldError as exc:
            raise FieldError(name, value, f"{exc.problem}, or auto") from None
    kind, optional = _unwrap_optional(hint)
    if optional and (value is None or value in NULL_WORDS):
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise FieldError(name, value, "must be true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise FieldError(name, value, "must be a whole number")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int past any float
                number = math.inf
            if math.isfinite(number):
                return number
            raise FieldError(name, value, "must be a finite number")
        raise FieldError(name, value, "must be a number")
    if kind is str:
        if isinstance(value, str):
            return value
        raise FieldError(name, value, "must be a string")
    return value


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved field types of an argument class, read once: resolving them compiles each annotation, and
    settings objects are made often (every `dataclasses.replace`, the planner's every candidate)."""
    return typing.get_type_hints(cls)


class Checked:
    """Base of every argument dataclass: types and `RULES` are checked when an instance is made."""

    RULES: ClassVar[dict[str, Rule]] = {}
    PLANNED: ClassVar[tuple[str, ...]] = ()  # fields a run settles at start where auto: the planner, the device
    SECTION: ClassVar[str] = ""  # the --help section of the fields this class declares (HELP_SECTIONS)
    IN_SECTION: ClassVar[dict[str, str]] = {}  # fields of this class shown in another section

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in fields(self):
            value = _check_type(f.name, hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
            rule = self.RULES.get(f.name)
            if rule is not None and value is not None and not (value == AUTO and _auto_or(hints[f.name])):
                problem = rule(f.name, value)
                if problem:
                    raise FieldError(f.name, value, problem)
        self.check()

    def check(self) -> None:
        """Rules between fields; raise UsageError."""


# ---- fields left auto ----------------------------------------------------------------------------

def unplanned_defaults(cls: type) -> dict[str, Any]:
    """{field: its value where nothing plans it} of `cls`'s planned true/false and number fields."""
    return {f.name: f.metadata[UNPLANNED] for f in fields(cls) if UNPLANNED in f.metadata}


def auto_fields(settings) -> set[str]:
    """The fields of `settings` a planner may choose (its class's PLANNED) that are left auto."""
    return {name for name in type(settings).PLANNED if getattr(settings, name) == AUTO}


def unplanned(settings):
    """`settings` with each true/false or number field left auto at its value where nothing plans it."""
    values = unplanned_defaults(type(settings))
    return replace(settings, **{name: value for name, value in values.items() if getattr(settings, name) == AUTO})


def _or_auto(kind: Callable) -> Callable:
    """An argparse `type` that also takes auto (argparse names `kind` in its message for a value it refuses)."""
    def read(text):
        return AUTO if text == AUTO else kind(text)
    read.__name__ = kind.__name__
    return read


# ---- parsing --------------------------------------------------------------------------------------

HELP_SECTIONS = ("model", "data", "training", "memory", "rollout", "method")  # --help's sections, in order


def section_of(cls: type, name: str) -> str:
    """Field `name`'s --help section: an IN_SECTION entry, else the SECTION of the class that declares it
    ("method" for a stage's own class, which sets none)."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("IN_SECTION", {}):
            return klass.__dict__["IN_SECTION"][name]
    declaring = next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))
    return declaring.__dict__.get("SECTION") or "method"


def parser_for(types: Sequence[type]):
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message: str):  # argparse would print the whole usage (dozens of flags) first
            raise UsageError(message)

        @staticmethod
        def _parse_dataclass_field(parser, field):
            """A planned true/false or number field takes auto too (its default), and one true where nothing plans
            it keeps its --no_NAME (transformers adds one where the default is True)."""
            if UNPLANNED not in field.metadata:
                return HfArgumentParser._parse_dataclass_field(parser, field)
            unplanned_value, field = field.metadata[UNPLANNED], copy.copy(field)
            field.metadata = {k: v for k, v in field.metadata.items() if k != UNPLANNED}
            HfArgumentParser._parse_dataclass_field(parser, field)
            action = parser._option_string_actions[f"--{field.name}"]
            action.type = _or_auto(action.type)
            if unplanned_value is True:
                parser.add_argument(f"--no_{field.name}", f"--no-{field.name.replace('_', '-')}", action="store_false",
                                    dest=field.name, default=False, help=field.metadata.get("help"))

    parser = Parser(list(types))
    if any(getattr(t, "SECTION", "") for t in types):
        _group_by_section(parser, types)
    return parser


def _group_by_section(parser, types: Sequence[type]) -> None:
    """--help in HELP_SECTIONS (model, data, training, memory, rollout, method) rather than one flat list."""
    sections = {f.name: section_of(t, f.name) for t in types for f in fields(t)}
    names = list(HELP_SECTIONS) + sorted(set(sections.values()) - set(HELP_SECTIONS))
    groups = {name: parser.add_argument_group(name) for name in names}
    for action in list(parser._actions):
        section = sections.get(action.dest)
        if section is None:
            continue  # --help itself
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        groups[section]._group_actions.append(action)


def parse(types: Sequence[type], argv: Sequence[str], defaults: Optional[dict[str, Any]] = None,
          defaults_from: Optional[str] = None) -> tuple:
    """Instances of `types` from command-line `argv`, over `defaults` (a config file's values, named by
    `defaults_from` in messages). Raises UsageError naming the flag or the config key at fault."""
    parser = parser_for(types)
    if defaults:
        parser.set_defaults(**_as_flags_read(parser, types, defaults, argv, defaults_from))
    try:
        return tuple(parser.parse_args_into_dataclasses(args=list(argv)))
    except UsageError as exc:
        if not isinstance(exc, FieldError):
            raise
        if defaults_from and not flag_given(exc.name, argv) and exc.name in (defaults or {}):
            raise UsageError(f"{defaults_from}: {exc.name}: {exc.value!r} {exc.problem}") from None
        raise
    except ValueError as exc:  # HfArgumentParser's own complaint about flags it does not know
        raise UsageError(f"unrecognized arguments: {' '.join(_leftover(str(exc)))}; --help lists them") from None


def flag_given(name: str, argv: Sequence[str]) -> bool:
    """`--name` (or --name-with-dashes, or a true/false field's `--no_name`) is on the command line."""
    flags = {f"--{prefix}{spelled}" for prefix in ("", "no_", "no-") for spelled in (name, name.replace("_", "-"))}
    return any(arg.partition("=")[0] in flags for arg in argv)


def _as_flags_read(parser, types: Sequence[type], values: dict[str, Any], argv: Sequence[str],
                   source: Optional[str]) -> dict[str, Any]:
    """Config `values` with each string in a number or true/false field read as its flag's would be ('2e-4', a
    string to YAML, is 2e-4); one that does not read so is refused naming `source` and the key (argparse would
    name a flag never given). A key whose flag is given is left as it is: its value is not used."""
    kinds = {name: hint for t in types for name, hint in type_hints(t).items()}
    actions = {action.dest: action for action in parser._actions  # not a true/false field's --no_NAME complement
               if f"--{action.dest}" in action.option_strings}
    out = dict(values)
    for name, value in values.items():
        action = actions.get(name)
        if not isinstance(value, str) or action is None or action.type in (None, str) or flag_given(name, argv):
            continue
        try:
            out[name] = action.type(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            try:
                out[name] = _check_type(name, kinds[name], value)  # a null word in an optional field: None
            except FieldError as exc:
                raise UsageError(f"{source or 'config'}: {name}: {value!r} {exc.problem}") from None
    return out


def _leftover(message: str) -> list[str]:
    import ast

    start = message.find("[")
    try:
        return [str(a) for a in ast.literal_eval(message[start:])] if start >= 0 else [message]
    except (ValueError, SyntaxError):
        return [message]


def argument_parser(prog: str, description: str):
    """An argparse parser (for the few tools with positional arguments) whose mistakes are one-line UsageErrors."""
    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            raise UsageError(message)

    return Parser(prog=prog, description=description)


_KEY = re.compile(r"^\s*[A-Za-z_][\w.]*\s*=")


def parse_assignments(text: Optional[str], flag: str) -> dict[str, str]:
    """'key=value,key2=value2' (the one syntax of every override flag) as a dict of strings. A part that does
    not start with `key=` continues the value before it, so a value may be a comma list itself:
    'reward_weights=1.0,0.5,max_steps=30' sets reward_weights to '1.0,0.5'."""
    out: dict[str, str] = {}
    key = None
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        if _KEY.match(item):
            key, _, value = (p.strip() for p in item.partition("="))
            out[key] = value
        elif key is None:
            raise UsageError(f"--{flag}: '{item}' is not key=value (use 'key=value,key2=value2')")
        else:
            out[key] += f",{item}"
    return out


def main_process() -> bool:
    return os.environ.get("RANK", "0") in ("0", "")


MAX_ERROR_CHARS = 2000


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An error's message, its first line (at most `limit` characters), or its type's name where it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


def run(main: Callable[[Optional[list[str]]], Any], argv: Optional[list[str]] = None) -> Any:
    """Call an entry point's `main`; our errors end the process with one line and exit code 2 or 1."""
    try:
        return main(argv)
    except UsageError as exc:
        code = 2
        message = str(exc)
    except InputError as exc:
        code = 1
        message = str(exc)
    if len(message) > MAX_ERROR_CHARS:  # a value echoed whole (a huge config value) would bury the line
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message):,} characters, cut)"
    if main_process():
        print(f"error: {message}", file=sys.stderr, flush=True)
    record_for_launcher(f"error: {message}")
    raise SystemExit(code)


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set for each process by torchrun (`accelerate launch --multi_gpu` ...)


def record_for_launcher(line: str) -> None:
    """Leave the error line where torch's elastic launcher looks for a failed process's cause (the file its
    `@record` writes), so its failure summary shows the line as the root cause's traceback."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the summary then says "To enable traceback see ..." as it would have
