"""The Python a workflow names: ``plugins:`` modules, ``reward.function: module:function``, an
environment's ``factory: module:attr``.

They are importable from the workflow's own directory, as a script's directory is for
``python script.py`` (:func:`import_beside`: the driver when it loads the workflow, every rank
process when it starts). ``posttrain validate`` finds each module without importing it
(:func:`missing_module`), so validate and run agree on what exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from posttrain.errors import UserError


def import_beside(base_dir: str) -> None:
    """Put the workflow's directory first on ``sys.path`` (once)."""
    path = os.path.abspath(base_dir)
    if path not in sys.path:
        sys.path.insert(0, path)


def split_reference(reference: str) -> tuple[str, str] | None:
    """``("module", "attr")`` of ``"module:attr"``; None when it is not of that form."""
    module, sep, attr = reference.partition(":")
    if not sep or not module or not attr:
        return None
    return module, attr


def missing_module(module: str) -> str | None:
    """Why ``module`` cannot be imported (None when it can be found), without importing it."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package is missing or broken
        return f"module '{module}' cannot be found ({exc})"
    if found is None:
        return f"module '{module}' cannot be found"
    return None


WHERE_MODULES_ARE = (
    "put the module next to the workflow file or on PYTHONPATH, or install its package"
)


def load_reference(reference: str, what: str) -> Any:
    """The object ``"module:attr"`` names; a :class:`UserError` starting with ``what`` (e.g.
    ``"reward.function"``) when it is malformed, cannot be imported or lacks the attribute."""
    parts = split_reference(reference)
    if parts is None:
        raise UserError(f"{what}: '{reference}' is not of the form 'module:attr'")
    module_name, attr = parts
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"{what}: cannot import module '{module_name}' ({exc}); {WHERE_MODULES_ARE}"
        ) from None
    found = getattr(module, attr, None)
    if found is None:
        raise UserError(f"{what}: module '{module_name}' has no '{attr}'")
    return found
