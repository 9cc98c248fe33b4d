"""Paths as messages show them: normalised, and short when they lie under the current directory.

A workflow's relative paths resolve against its own directory, which gives joins such as
``/repo/examples/../runs/quickstart``; a user reads that as ``runs/quickstart``.
"""

from __future__ import annotations

import os


def display_path(path: str | os.PathLike[str]) -> str:
    """``path`` normalised: relative to the current directory when it lies under it (``.`` for
    the directory itself), else absolute."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, os.getcwd())
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return absolute
    return relative
