"""``posttrain sandbox run FILE.py``: one file through the local sandbox, its result as JSON;
and the guarantees table of ``posttrain doctor``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import attrs

from posttrain.config.ranges import range_of
from posttrain.errors import UserError

if TYPE_CHECKING:
    import argparse

    from posttrain.host.plugin_host import PluginHost
    from posttrain.sandbox.result import SandboxLimits

# CLI flag -> SandboxLimits field.
_FLAGS = {
    "timeout_s": "--timeout-s",
    "memory_mb": "--memory-mb",
    "cpu_time_s": "--cpu-time-s",
    "max_processes": "--max-processes",
    "max_output_bytes": "--max-output-bytes",
}


def add_sandbox_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sandbox = sub.add_parser("sandbox", help="run code in the local sandbox (docs/sandbox.md)")
    actions = sandbox.add_subparsers(dest="sandbox_command", metavar="ACTION")
    actions.required = True
    run = actions.add_parser(
        "run",
        help="run FILE.py in the sandbox; print stdout, stderr, exit_code, timed_out and "
        "killed_reason as JSON (exit 0 whatever the program did)",
    )
    run.add_argument("file", metavar="FILE.py", help="the Python program to run")
    run.add_argument("--timeout-s", type=float, default=10.0, help="wall-clock limit (10)")
    run.add_argument("--memory-mb", type=int, default=1024, help="address-space limit (1024)")
    run.add_argument("--cpu-time-s", type=int, default=None, help="CPU limit (the timeout)")
    run.add_argument("--max-processes", type=int, default=32, help="process-count limit (32)")
    run.add_argument("--max-output-bytes", type=int, default=65536, help="of each stream kept")
    run.add_argument(
        "--isolation",
        choices=("auto", "strict", "bubblewrap", "rlimits"),
        default="auto",
        help="auto: bubblewrap where it runs, else rlimits only, with a warning on stderr (the "
        "result says which); strict (or bubblewrap): bubblewrap, or exit 2 where it cannot "
        "run; rlimits: limits only (docs/sandbox.md)",
    )
    run.set_defaults(handler=cmd_sandbox_run)


def _limits(args: argparse.Namespace) -> SandboxLimits:
    """The limits the flags ask for; every flag out of range reported at once."""
    from posttrain.sandbox.result import SandboxLimits

    fields = attrs.fields_dict(SandboxLimits)
    problems = []
    for name, flag in _FLAGS.items():
        value = getattr(args, name)
        allowed = range_of(fields[name])
        if value is not None and allowed is not None and not allowed.admits(value):
            problems.append(f"{flag} {value}: out of range; allowed: {allowed.describe()}")
    if problems:
        raise UserError("; ".join(problems))
    return SandboxLimits(**{name: getattr(args, name) for name in _FLAGS})


def cmd_sandbox_run(args: argparse.Namespace, host: PluginHost) -> int:
    from posttrain.sandbox.local import resolve_level, run_python, warn_fallback_once

    limits = _limits(args)
    try:
        with open(args.file, encoding="utf-8") as file:
            code = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {args.file}: {exc}") from None
    level = resolve_level(args.isolation)
    warn_fallback_once(args.isolation, level)  # before the program runs, uncontained
    result = run_python(code, limits, isolation=level)
    sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    return 0


def guarantee_rows() -> list[tuple[str, str, str]]:
    """(guarantee, holds with the best isolation here, how) for ``posttrain doctor``."""
    from posttrain.sandbox.isolation import detect

    found = detect()
    rows = [
        (
            "isolation",
            found.best,
            "bubblewrap runs here"
            if found.bubblewrap
            else f"no bubblewrap: {found.bubblewrap_problem}; {found.remedy}",
        )
    ]
    if found.prlimit is None:
        rows.append(("rlimits", "no", "util-linux's prlimit is missing: the sandbox cannot run"))
    for guarantee in found.guarantees(found.best):
        rows.append((guarantee.name, "yes" if guarantee.holds else "no", guarantee.how))
    return rows
