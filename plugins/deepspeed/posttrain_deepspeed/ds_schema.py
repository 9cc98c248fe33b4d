"""DeepSpeed's config schema, read from the installed sources without importing DeepSpeed.

``posttrain validate`` must stay fast and torch-free, and ``import deepspeed`` imports torch. The
``zero_optimization`` section is a pydantic model (``DeepSpeedZeroConfig``, extra keys
forbidden): its field names and aliases are read with :mod:`ast`. Top-level keys are looked up
in DeepSpeed's ``constants.py`` / ``config.py`` modules (the string constants its config parser
reads): a superset of the valid keys, so a misspelt key is caught without refusing valid ones.
DeepSpeed checks the whole config again when the engine starts.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os


def _root() -> str | None:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError):
        return None


def model_fields(tree: ast.Module, class_name: str) -> set[str]:
    """Field names and ``alias=`` names of a pydantic model class in ``tree``."""
    fields: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields.add(stmt.target.id)
                if isinstance(stmt.value, ast.Call):
                    for kw in stmt.value.keywords:
                        if kw.arg == "alias" and isinstance(kw.value, ast.Constant):
                            fields.add(str(kw.value.value))
    return fields


@functools.cache
def zero_config_keys() -> frozenset[str] | None:
    """Every key ``zero_optimization`` accepts; None when DeepSpeed is not installed."""
    root = _root()
    if root is None:
        return None
    tree = _parse(os.path.join(root, "runtime", "zero", "config.py"))
    if tree is None:
        return None
    return frozenset(model_fields(tree, "DeepSpeedZeroConfig")) or None


@functools.cache
def known_config_strings() -> frozenset[str] | None:
    """String constants of DeepSpeed's config modules: every top-level key is among them."""
    root = _root()
    if root is None:
        return None
    found: set[str] = set()
    for directory, _, files in os.walk(root):
        if os.sep + "ops" in directory[len(root) :]:
            continue
        for name in files:
            if name not in ("constants.py", "config.py"):
                continue
            tree = _parse(os.path.join(directory, name))
            if tree is None:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    value = node.value
                    if value.isidentifier() and len(value) < 64:
                        found.add(value)
    return frozenset(found) or None
