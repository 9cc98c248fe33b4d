"""The names an engine module defines, read from its source without importing it.

Engine modules import torch and their engine, which ``posttrain validate``, ``posttrain plugins``
and the entry-point modules must never do; their top-level functions (and imported names) can
still be listed by parsing the file.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec


def engine_names(module: str) -> frozenset[str] | None:
    """Top-level functions and imported names of ``module`` (descending into top-level ``if``,
    ``try`` and ``with`` blocks; names from core's public faces left out), or None when
    its source cannot be read or cannot tell (no file, a syntax error, a ``from x import *``)."""
    spec = _find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        stat = os.stat(spec.origin)
    except OSError:
        return None
    return _names_in_file(spec.origin, stat.st_mtime_ns, stat.st_size)


def _find_spec(module: str) -> ModuleSpec | None:
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, "__spec__", None)
    parent = module.rpartition(".")[0]
    if not parent or parent in sys.modules:
        try:
            return importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
    # importlib.util.find_spec would import the parent packages, whose __init__ may import the
    # engine: look each level up on the file system instead.
    parts = module.split(".")
    path = None
    spec = None
    for depth in range(1, len(parts) + 1):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec


@functools.lru_cache(maxsize=64)
def _names_in_file(path: str, _mtime_ns: int, _size: int) -> frozenset[str] | None:
    # Keyed by modification time and size too: a test may rewrite an engine file in place.
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names: set[str] = set()
    if not _collect(tree.body, names):
        return None
    return frozenset(names)


def _collect(body: list[ast.stmt], names: set[str]) -> bool:
    """Add the names ``body`` binds at module level; False when a star import hides them."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if any(a.name == "*" for a in node.names):
                return False
            # Core's helpers (score_logprobs, ...) from the public faces are not engine hooks.
            if node.module not in ("posttrain", "posttrain.backend"):
                names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            if not all(_collect(block, names) for block in blocks):
                return False
    return True
