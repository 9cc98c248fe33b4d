"""Safe YAML loading that rejects duplicate keys (PyYAML silently keeps the last one)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from posttrain.config.report import ErrorReport


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate mapping keys instead of overwriting them."""

    duplicates: list[tuple[str, int]]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                self.duplicates.append((str(key), key_node.start_mark.line + 1))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads ``1e-6`` (no dot) as a string; ROLL's loader (OmegaConf) reads it as a float,
# and ROLL workflows write learning rates that way. Same pattern as OmegaConf's.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def load_yaml_text(text: str, source: str, report: ErrorReport) -> Any:
    """Parse ``text``; syntax errors and duplicate keys go to ``report``. Returns None on error."""
    loader = _StrictLoader(text)
    loader.duplicates = []
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else source
        report.error(
            "",
            f"invalid YAML at {where}: {getattr(exc, 'problem', exc)}",
            "check indentation and quoting",
        )
        return None
    finally:
        loader.dispose()
    for key, line in sorted(loader.duplicates, key=lambda d: d[1]):
        report.error(
            "",
            f"duplicate key '{key}' at line {line}",
            "each key may appear once per mapping; remove or merge the copies",
        )
    return data


def load_yaml_value(text: str) -> Any:
    """One value as ``--set KEY=VALUE`` gives it, read as a workflow file's values are (so
    ``1e-3`` is a number there too); raises ``yaml.YAMLError``."""
    loader = _StrictLoader(text)
    loader.duplicates = []
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
