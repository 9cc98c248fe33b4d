"""The ``posttrain`` command line. Exit codes: 0 ok, 2 user error, 1 internal error.

User errors print a message and no traceback; internal errors print the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import traceback
import warnings

from posttrain.errors import PluginWarning, UserError, WorkerError
from posttrain.paths import display_path

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _parse_overrides(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.max_steps=10")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _load(args, host):
    from posttrain.config.workflow import load_workflow

    workflow, report = load_workflow(args.workflow, host, _parse_overrides(args.set))
    return workflow, report


def cmd_validate(args, host) -> int:
    workflow, report = _load(args, host)
    console = _console()
    for note in report.notes:
        console.print(f"[dim]note: {note.render()}[/dim]")
    report.raise_if_errors(display_path(args.workflow))
    roles = ", ".join(
        f"{n}={r.strategy_args.strategy_name}[{r.num_ranks}]" for n, r in workflow.roles().items()
    )
    console.print(f"[green]ok[/green]: {display_path(args.workflow)} ({roles})")
    return EXIT_OK


def cmd_plugins(args, host) -> int:
    listing = _plugin_listing(host)
    if args.json:
        sys.stdout.write(json.dumps({"plugins": listing}, indent=2) + "\n")
    else:
        _print_plugin_blocks(_console(), listing)
    return EXIT_OK if not host.failures else EXIT_USER


def _plugin_listing(host) -> list[dict]:
    """Every plugin with its distribution, version, strategies and hooks (full hook names)."""
    strategies = host.strategies()
    return [
        {
            "name": info.name,
            "source": info.source,
            "distribution": info.distribution or None,
            "version": info.version or None,
            "strategies": sorted(s.name for s in strategies.values() if s.plugin == info.name),
            "hooks": [] if info.error else host.hooks_of(info.name),
            "error": info.error or None,
        }
        for info in host.plugins
    ]


def _print_plugin_blocks(console, listing: list[dict]) -> None:
    """One block per plugin, its lists wrapped between names: a table would cut hook names in
    an 80-column terminal or a pipe."""

    def wrapped(label: str, items: list[str]) -> str:
        return textwrap.fill(
            ", ".join(items),
            width=console.width,
            initial_indent=f"  {label}: ",
            subsequent_indent=" " * (len(label) + 4),
            break_long_words=False,
            break_on_hyphens=False,
        )

    for number, plugin in enumerate(listing):
        if number:
            console.print()
        origin = " ".join(filter(None, (plugin["distribution"], plugin["version"])))
        where = f"{plugin['source']}; {origin}" if origin else plugin["source"]
        console.print(f"{plugin['name']} ({where})", style="bold", markup=False)
        if plugin["error"]:
            # Unwrapped: the error is one message, searched for as a whole.
            console.print(f"  failed to load: {plugin['error']}", style="red", markup=False)
            continue
        if plugin["strategies"]:
            console.print(wrapped("strategies", plugin["strategies"]), markup=False)
        hooks = [h.removeprefix("posttrain_") for h in plugin["hooks"]]
        console.print(wrapped("hooks", hooks), markup=False)


def cmd_doctor(args, host) -> int:
    from rich.table import Table

    from posttrain.doctor import run_check

    console = _console()
    table = Table(title="posttrain doctor")
    for column in ("plugin", "package", "installed", "tested", "status"):
        table.add_column(column)
    worst = EXIT_OK
    colors = {"ok": "green", "untested": "yellow", "missing": "red", "optional-missing": "dim"}
    for checks in host.hook.posttrain_environment_checks():
        for check in checks or []:
            result = run_check(check)
            table.add_row(
                check.plugin,
                check.package,
                result.version or "-",
                check.tested,
                f"[{colors[result.status]}]{result.status}[/]",
            )
            if result.status == "missing":
                worst = EXIT_USER
    for info in host.failures:
        table.add_row(info.name, "-", "-", "-", f"[red]plugin failed: {info.error}[/red]")
        worst = EXIT_USER
    console.print(table)
    return worst


def cmd_run(args, host) -> int:
    from posttrain.trainer.run import run_workflow

    workflow, report = _load(args, host)
    report.raise_if_errors(display_path(args.workflow))
    run_workflow(workflow, host, source=args.workflow, console=_console())
    return EXIT_OK


def cmd_export_hf(args, host) -> int:
    from posttrain.trainer.export import export_checkpoint_to_hf

    export_checkpoint_to_hf(args.checkpoint, args.output, host, console=_console(), role=args.role)
    return EXIT_OK


def build_parser(host) -> argparse.ArgumentParser:
    from posttrain import __version__

    parser = argparse.ArgumentParser(
        prog="posttrain",
        description=("RL post-training of language models with pluggable backends."),
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def workflow_command(name: str, handler, help_: str):
        p = sub.add_parser(name, help=help_)
        p.add_argument("workflow", help="workflow YAML file")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a workflow value, e.g. --set trainer.max_steps=10",
        )
        p.set_defaults(handler=handler)

    workflow_command("validate", cmd_validate, "check a workflow; every error at once")
    workflow_command("run", cmd_run, "run a workflow")
    p = sub.add_parser("plugins", help="installed plugins, their strategies and hooks")
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")
    p.set_defaults(handler=cmd_plugins)
    sub.add_parser("doctor", help="engine versions against tested ranges").set_defaults(
        handler=cmd_doctor
    )
    p = sub.add_parser("export-hf", help="write a checkpoint as an HF model directory")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoint-N")
    p.add_argument("output", help="output directory")
    p.add_argument(
        "--role",
        default="actor_train",
        choices=("actor_train", "critic"),
        help="the trained role to export (default: the policy)",
    )
    p.set_defaults(handler=cmd_export_hf)
    host.hook.posttrain_add_cli_commands(subparsers=sub)
    return parser


def _show_warnings(err, caught: list[warnings.WarningMessage]) -> None:
    """Plugin warnings as the CLI's own (like a plugin that failed to load); others as Python
    would have shown them."""
    from rich.markup import escape

    for w in caught:
        if issubclass(w.category, PluginWarning):
            err.print(f"[yellow]warning[/yellow]: {escape(str(w.message))}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def main(argv: list[str] | None = None) -> int:
    err = _console(stderr=True)
    try:
        from posttrain.plugin_host import create_plugin_host

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default", PluginWarning)
            host = create_plugin_host()
        _show_warnings(err, caught)
        for info in host.failures:
            err.print(
                f"[yellow]warning[/yellow]: plugin '{info.name}' failed to load: {info.error}"
            )
        args = build_parser(host).parse_args(argv)
        return args.handler(args, host)
    except UserError as exc:
        err.print(f"[red]error[/red]: {exc}")
        return EXIT_USER
    except WorkerError as exc:
        err.print(f"[red]error[/red]: {exc}\n{exc.remote_traceback}")
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception:
        traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
