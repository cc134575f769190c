"""The one reader of sectioned YAML config files (`model:`, `data:`, `train:`, `stage:`): a key or section
written twice, aliases that expand past any real config and nesting Python cannot follow are refused in one
line, and every key must belong to its section's argument class (`foundation.settings`).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from foundation.cli import UsageError

SECTIONS = ("model", "data", "train", "stage")


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (PyYAML would silently keep the last value)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: a section, or a key in a section."""

    def construct_document(self, node):
        self.root, self.sections = node, {}
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            top = node is getattr(self, "root", None)
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults` and then an override is what YAML merges are for
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # SafeLoader refuses it itself
                line = key_node.start_mark.line + 1
                if key in seen:
                    if top:
                        raise DuplicateKey(f"section '{key}' appears twice (lines {seen[key]} and {line}): merge "
                                           "them into one")
                    section = self.sections.get(id(node))
                    where = f"section '{section}'" if section is not None else "one mapping"
                    raise DuplicateKey(f"key '{key}' appears twice in {where} (lines {seen[key]} and {line}): "
                                       "keep one")
                seen[key] = line
                if top:
                    self.sections[id(value_node)] = key
        return super().construct_mapping(node, deep)


MAX_YAML_VALUES = 100_000  # values a config may hold once its aliases are expanded: far past any real config


def _expanded_size(node, sizes: dict) -> int:
    """How many values `node` holds once every alias in it is expanded (a shared node counts each time)."""
    if id(node) not in sizes:
        sizes[id(node)] = 0  # a node that holds itself (a recursive alias) counts once
        children = [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        sizes[id(node)] = min(1 + sum(_expanded_size(child, sizes) for child in children), MAX_YAML_VALUES + 1)
    return sizes[id(node)]


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A config file's sections as written (a key or section written twice is refused), unchecked. Aliases
    that expand past MAX_YAML_VALUES values, and nesting Python cannot follow, are refused in one line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=UniqueKeyLoader)
        if node is not None and _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise UsageError(f"{path}: its aliases expand to more than {MAX_YAML_VALUES:,} values; write the "
                             "config out without them")
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except RecursionError:
        raise UsageError(f"{path}: nested too deep to read") from None
    except DuplicateKey as exc:
        raise UsageError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{path}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected sections {', '.join(SECTIONS)}, got a {type(raw).__name__}")
    return raw


def config_flag(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """(the --config file, the other flags): every command that reads a config file takes it so."""
    argv = list(argv)
    if "--config" not in argv:
        return None, argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise UsageError("--config needs a YAML file path")
    path = argv[i + 1]
    del argv[i : i + 2]
    return path, argv


def load_yaml(path: str | os.PathLike, section_types: dict[str, type],
              beside: Sequence[str] = ()) -> dict[str, Any]:
    """The values of a sectioned YAML config, flattened, after checking every section and key.

    `section_types` maps each allowed section to its dataclass; a key must belong to its section's class,
    but in the sections named by `beside`, whose keys the reader does not take (the memory estimator reading
    a stage's method settings), which are left out.
    """
    path = Path(path)
    raw = read_yaml(path)
    if not any(raw.values()):  # a config that sets nothing is a wrong or truncated file, not a run on the defaults
        raise UsageError(f"{path}: sets nothing (empty, only comments or only empty sections): write key: value lines "
                         f"under {', '.join(f'{s}:' for s in section_types)}, or leave out --config for the defaults")
    flat: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in section_types:
            owner = _owner(section, section_types)
            hint = f" ('{section}' is a key of section '{owner}': put it under {owner}:)" if owner else ""
            raise UsageError(f"{path}: unknown section '{section}'; sections: {', '.join(section_types)}{hint}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UsageError(f"{path}: section '{section}' must hold key: value lines")
        known = {f.name for f in fields(section_types[section])}
        for key, value in values.items():
            if key not in known and section in beside:
                continue
            if key not in known:
                owner = _owner(key, section_types)
                hint = f" (it belongs in section '{owner}')" if owner else f"; known keys: {', '.join(sorted(known))}"
                raise UsageError(f"{path}: unknown key '{key}' in section '{section}'{hint}")
            flat[key] = value
    return flat


def _owner(key: str, section_types: dict[str, type]) -> Optional[str]:
    return next((s for s, cls in section_types.items() if key in {f.name for f in fields(cls)}), None)
