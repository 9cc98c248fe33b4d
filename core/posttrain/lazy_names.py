"""A public face's names imported when first used (``posttrain``, ``posttrain.backend``): the
module-level ``__getattr__`` and ``__dir__`` of PEP 562, made from the face's one list."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    face: str, public: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for module ``face`` whose names map to their defining modules
    in ``public``; a resolved name is kept in ``namespace`` (the module's globals)."""

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # imported once
        return value

    def __dir__() -> list[str]:
        return sorted(namespace["__all__"])

    return __getattr__, __dir__
