"""The field names of megatron-core's ``TransformerConfig``, read without importing it.

``posttrain validate`` must stay fast and torch-free, and importing megatron-core imports torch
(~7 s). The dataclass fields are read from the installed sources with :mod:`ast` instead:
``TransformerConfig`` and its base ``ModelParallelConfig`` are plain annotated dataclasses.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

_SOURCES = (
    ("transformer/transformer_config.py", "TransformerConfig"),
    ("model_parallel_config.py", "ModelParallelConfig"),
)


def _class_fields(path: str, class_name: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
    return set()


@functools.cache
def transformer_config_fields() -> frozenset[str] | None:
    """Every field ``TransformerConfig(**kwargs)`` accepts; None when megatron-core is absent."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    fields: set[str] = set()
    for relative, class_name in _SOURCES:
        path = os.path.join(root, relative)
        if os.path.exists(path):
            fields |= _class_fields(path, class_name)
    return frozenset(fields) or None
