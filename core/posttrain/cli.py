"""The ``posttrain`` command line. Exit codes: 0 ok, 2 user error, 1 internal error.

User errors print a message and no traceback; internal errors print the traceback.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import sys
import textwrap
import threading
import traceback
import warnings
from typing import TYPE_CHECKING, Any

from posttrain.errors import PluginWarning, UserError, WorkerError
from posttrain.paths import display_path

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import FrameType

    from rich.console import Console
    from rich.table import Table

    from posttrain.commands.config_keys import ConfigKey
    from posttrain.config.report import ConfigIssue, ErrorReport
    from posttrain.config.sections import Workflow
    from posttrain.host.plugin_host import PluginHost
    from posttrain.host.strategy import StrategySpec

    # A command: the parsed arguments and the plugin host in, the exit code out.
    Handler = Callable[[argparse.Namespace, PluginHost], int]

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


# The width of tables written to a pipe or a file: rich would take 80 columns there and cut
# names to fit; as wide as this, a table is as wide as its longest cells.
_UNBOUNDED_WIDTH = 1000


def _table_console() -> Console:
    """stdout's console for tables: the terminal's width in a terminal, else unbounded (a
    table sizes itself to its cells, so ``posttrain doctor | grep`` sees whole names)."""
    console = _console()
    if not console.is_terminal:
        console.width = _UNBOUNDED_WIDTH
    return console


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items; each value is parsed as YAML, and a relative path given for
    a path setting is made absolute against the current directory (:func:`_from_cwd`)."""
    import yaml

    from posttrain.config.yaml_loader import load_yaml_value

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.max_steps=10")
        try:
            value = load_yaml_value(text)
        except yaml.YAMLError as exc:
            raise UserError(
                f"--set {item!r}: the value is not valid YAML ({str(exc).splitlines()[0]}); "
                f"quote it: --set '{key}=\"{text}\"'"
            ) from None
        out[key] = _from_cwd(key, value)
    return out


# Settings that hold a path. Given with --set, a relative path is meant from where the command
# is typed, not from the workflow file's directory (where the file's own paths resolve).
_PATH_KEYS = ("trainer.output_dir", "data.path")
_MODEL_PATH_KEYS = ("model_name_or_path", "tokenizer_name_or_path")


def _from_cwd(key: str, value: Any) -> Any:
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return value
    if key in _PATH_KEYS or (key == "trainer.resume" and value not in ("auto", "never")):
        return os.path.abspath(value)
    if key.rsplit(".", 1)[-1] in _MODEL_PATH_KEYS and os.path.exists(value):
        return os.path.abspath(value)  # else a preset or a hub id
    return value


SET_HELP = (
    "override a workflow value, e.g. --set trainer.max_steps=10 (repeatable). VALUE is parsed "
    "as YAML: 10 is a number, [0,1] a list, null nothing; quote a string that YAML would read "
    "otherwise, e.g. --set 'key=\"-\"'. Paths in the workflow file resolve against the file's "
    "directory; a relative path given here (trainer.output_dir, trainer.resume, data.path, "
    "*.model_name_or_path) resolves against the current directory"
)


def _load(args: argparse.Namespace, host: PluginHost) -> tuple[Workflow | None, ErrorReport]:
    """The workflow (None when it could not be built) and its report; its warnings are shown
    here, for every command that loads one (a run goes on after them)."""
    from posttrain.loading.workflow import load_workflow

    workflow, report = load_workflow(args.workflow, host, _parse_overrides(args.set))
    _print_warnings(report.warnings)
    return workflow, report


def _load_checked(args: argparse.Namespace, host: PluginHost) -> Workflow:
    """The workflow; a :class:`~posttrain.config.report.ConfigError` listing every error when
    it has any."""
    workflow, report = _load(args, host)
    report.raise_if_errors(display_path(args.workflow))
    assert workflow is not None  # only a report with errors comes without a workflow
    return workflow


def _print_warnings(warnings: Iterable[ConfigIssue]) -> None:
    from rich.markup import escape

    for warning in warnings:
        _console(stderr=True).print(f"[yellow]warning[/yellow]: {escape(warning.render())}")


def cmd_validate(args: argparse.Namespace, host: PluginHost) -> int:
    from rich.markup import escape

    from posttrain.config.report import ErrorReport
    from posttrain.loading.hub_models import warn_uncached

    workflow, report = _load(args, host)
    if workflow is not None:
        # Only here: a run asks the hub itself (check_reachable), and says what it found.
        uncached = ErrorReport()
        warn_uncached(workflow, uncached)
        _print_warnings(uncached.warnings)
    console = _console()
    for note in report.notes:
        console.print(f"[dim]note: {escape(note.render())}[/dim]")
    report.raise_if_errors(display_path(args.workflow))
    assert workflow is not None  # only a report with errors comes without a workflow
    roles = ", ".join(
        f"{n}={r.strategy_args.strategy_name}[{r.num_ranks}]" for n, r in workflow.roles().items()
    )
    console.print(f"[green]ok[/green]: {display_path(args.workflow)} ({roles})")
    return EXIT_OK


def cmd_plugins(args: argparse.Namespace, host: PluginHost) -> int:
    if args.config is not None:
        return _print_strategy_config(args.config, host, args.json)
    listing = _plugin_listing(host)
    if args.json:
        sys.stdout.write(json.dumps({"plugins": listing}, indent=2) + "\n")
    else:
        _print_plugin_blocks(_console(), listing)
    return EXIT_OK if not host.failures else EXIT_USER


def _print_strategy_config(name: str, host: PluginHost, as_json: bool) -> int:
    """``posttrain plugins --config NAME``: the keys of strategy NAME's ``strategy_config``,
    read from its config class (the plugin's module, already loaded; no engine is imported)."""
    import attrs

    from posttrain.commands.config_keys import config_keys

    strategies = host.strategies()
    spec = strategies.get(name)
    if spec is None:
        from posttrain.config.report import unknown_name_hint
        from posttrain.host.strategy import KNOWN_PROVIDERS

        hint = unknown_name_hint(name, strategies, "strategies", KNOWN_PROVIDERS)
        raise UserError(f"--config {name}: no installed plugin declares this strategy; {hint}")
    keys = config_keys(spec.config_class)
    if as_json:
        described = {
            "strategy": spec.name,
            "plugin": spec.plugin,
            "config_class": f"{spec.config_class.__module__}.{spec.config_class.__qualname__}",
            "doc": _class_doc(spec),
            "keys": [attrs.asdict(key) for key in keys],
        }
        sys.stdout.write(json.dumps(described, indent=2) + "\n")
        return EXIT_OK
    console = _console()
    config = spec.config_class
    console.print(
        f"{spec.name}: strategy_config keys ({config.__module__}.{config.__qualname__}, "
        f"plugin {spec.plugin})",
        style="bold",
        markup=False,
    )
    doc = _class_doc(spec)
    if doc:
        console.print(_fill(doc, console.width, "  "), markup=False)
    if not keys:
        console.print("  (no keys)", markup=False)
    for line in _key_lines(keys, console.width, "  "):
        console.print(line, markup=False)
    return EXIT_OK


def _class_doc(spec: StrategySpec) -> str:
    """The config class's docstring (its own, not inherited), else the strategy's description."""
    doc = spec.config_class.__doc__
    text = inspect.cleandoc(doc) if doc else spec.description
    return text.replace("``", "`")


def _key_lines(keys: Iterable[ConfigKey], width: int, indent: str) -> list[str]:
    """Each key as ``key: type; default D`` with its description wrapped below it, the keys of
    a nested class indented under their key."""
    from posttrain.commands.config_keys import NO_VALUE

    lines = []
    for key in keys:
        default = key.default if key.default in NO_VALUE else f"default {key.default}"
        lines.append(f"\n{indent}{key.key}: {key.type}; {default}")
        if key.doc:
            lines.append(_fill(key.doc, width, indent + "    "))
        lines += _key_lines(key.keys, width, indent + "    ")
    return lines


def _fill(text: str, width: int, indent: str) -> str:
    """``text`` wrapped to ``width`` at ``indent``, its paragraphs kept apart."""
    return "\n\n".join(
        textwrap.fill(
            " ".join(paragraph.split()),
            width=width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        )
        for paragraph in text.split("\n\n")
    )


# What a plugin adds, by kind: the collecting hook that declares it (a mapping of names).
CONTRIBUTION_HOOKS = {
    "algorithms": "posttrain_add_algorithms",
    "advantage_estimators": "posttrain_add_advantage_estimators",
    "policy_losses": "posttrain_add_policy_losses",
    "reward_functions": "posttrain_add_reward_functions",
    "environments": "posttrain_add_environments",
    "loggers": "posttrain_add_loggers",
    "weight_transports": "posttrain_add_weight_transports",
}


def _plugin_listing(host: PluginHost) -> list[dict[str, Any]]:
    """Every plugin with its distribution, version, what it adds by kind (strategies,
    algorithms, rewards, environments, transports, commands) and its hooks (full names).

    An :class:`~posttrain.EngineHooks` plugin implements every worker hook, each calling the
    engine function of its name; ``hooks`` lists those whose function its engine module defines
    (read from its source), ``engine_lacks`` the others (they answer nothing; None when the
    engine's source cannot tell, and ``hooks`` then lists them all)."""
    strategies = host.strategies()
    contributions = _contributions(host)
    listing = []
    for info in host.plugins:
        hooks = [] if info.error else host.hooks_of(info.name)
        lacks = [] if info.error else host.engine_lacks(info.name)
        listing.append(
            {
                "name": info.name,
                "source": info.source,
                "distribution": info.distribution or None,
                "version": info.version or None,
                "strategies": sorted(s.name for s in strategies.values() if s.plugin == info.name),
                **{kind: sorted(found.get(info.name, ())) for kind, found in contributions.items()},
                "hooks": [h for h in hooks if h not in (lacks or ())],
                "engine_lacks": lacks,
                "error": info.error or None,
            }
        )
    return listing


def _contributions(host: PluginHost) -> dict[str, dict[str, list[str]]]:
    """``{kind: {plugin name: [names it declares]}}``; declarations are cheap (no engine is
    imported), so they are asked of every plugin."""
    found: dict[str, dict[str, list[str]]] = {}
    for kind, hook_name in CONTRIBUTION_HOOKS.items():
        found[kind] = {
            impl.plugin_name: list(impl.function() or {})
            for impl in getattr(host.hook, hook_name).get_hookimpls()
        }
    commands: dict[str, list[str]] = {}
    for impl in host.hook.posttrain_add_cli_commands.get_hookimpls():
        # Each plugin adds its subcommands to a parser of its own, to read their names.
        subparsers = argparse.ArgumentParser(add_help=False).add_subparsers()
        impl.function(subparsers=subparsers)
        commands[impl.plugin_name] = list(subparsers.choices)
    found["commands"] = commands
    return found


def _print_plugin_blocks(console: Console, listing: list[dict[str, Any]]) -> None:
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
        for kind in ("strategies", *CONTRIBUTION_HOOKS, "commands"):
            if plugin[kind]:
                console.print(wrapped(kind.replace("_", " "), plugin[kind]), markup=False)
        hooks = [h.removeprefix("posttrain_") for h in plugin["hooks"]]
        console.print(wrapped("hooks", hooks), markup=False)
        if plugin["engine_lacks"] is None:
            console.print("  engine lacks: unknown (its source cannot be read)", markup=False)
        elif plugin["engine_lacks"]:
            lacks = [h.removeprefix("posttrain_") for h in plugin["engine_lacks"]]
            console.print(wrapped("engine lacks", lacks), markup=False)


def cmd_doctor(args: argparse.Namespace, host: PluginHost) -> int:
    from rich.table import Table

    from posttrain.host.doctor import run_check

    console = _table_console()
    table = Table(title="posttrain doctor")
    for column in ("plugin", "package", "installed", "tested", "status"):
        table.add_column(column, overflow="fold")  # a narrow terminal wraps, never cuts
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
    console.print(_sandbox_table())
    return worst


def _sandbox_table() -> Table:
    """Which guarantees the local sandbox (posttrain sandbox run, python_sandbox) has here."""
    from rich.table import Table

    from posttrain.sandbox.command import guarantee_rows

    table = Table(title="sandbox guarantees on this machine (docs/sandbox.md)")
    for column in ("guarantee", "holds", "how"):
        table.add_column(column, overflow="fold")
    colors = {"no": "red", "yes": "green"}
    for name, holds, how in guarantee_rows():
        table.add_row(name, f"[{colors.get(holds, 'bold')}]{holds}[/]", how)
    return table


def cmd_run(args: argparse.Namespace, host: PluginHost) -> int:
    from posttrain.commands.run import run_workflow

    workflow = _load_checked(args, host)
    run_workflow(workflow, host, source=args.workflow, console=_console())
    return EXIT_OK


def cmd_plan(args: argparse.Namespace, host: PluginHost) -> int:
    from posttrain.memory.command import print_plan

    workflow = _load_checked(args, host)
    if args.gpus is not None and args.from_run is None:
        raise UserError("--gpus N goes with --from-run RUN_DIR (the GPUs to split)")
    if args.from_run is not None:  # the trainer/rollout split from a run's phase times
        from posttrain.memory.split import print_split

        fits = print_split(
            workflow, host, _table_console(), args.from_run, args.gpus, args.gpu_memory_gib
        )
        return EXIT_OK if fits else EXIT_USER
    fits = print_plan(workflow, host, _console(), args.gpu_memory_gib)
    return EXIT_OK if fits else EXIT_USER


def cmd_eval(args: argparse.Namespace, host: PluginHost) -> int:
    from posttrain.commands.evaluate import evaluate_checkpoint

    workflow = _load_checked(args, host)
    evaluate_checkpoint(workflow, host, args.checkpoint, args.out, _console(), source=args.workflow)
    return EXIT_OK


def cmd_export_hf(args: argparse.Namespace, host: PluginHost) -> int:
    from posttrain.commands.export_hf import export_checkpoint_to_hf

    export_checkpoint_to_hf(
        args.checkpoint, args.output, host, console=_console(), role=args.role, merge=args.merge
    )
    return EXIT_OK


def cmd_stacks(args: argparse.Namespace, host: PluginHost) -> int:
    from posttrain.launch.stacks import live_run_stacks

    print(live_run_stacks(args.run_dir, all_threads=args.all_threads))
    return EXIT_OK


def build_parser(host: PluginHost) -> argparse.ArgumentParser:
    from posttrain.sandbox.command import add_sandbox_parser
    from posttrain.version import __version__

    parser = argparse.ArgumentParser(
        prog="posttrain",
        description=("RL post-training of language models with pluggable backends."),
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def workflow_command(name: str, handler: Handler, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument(
            "workflow",
            help="workflow YAML file; relative paths in it resolve against its directory",
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=SET_HELP,
        )
        p.set_defaults(handler=handler)
        return p

    workflow_command("validate", cmd_validate, "check a workflow; every error at once")
    workflow_command("run", cmd_run, "run a workflow")
    p = workflow_command(
        "plan", cmd_plan, "each GPU's estimated memory by role and phase, before anything starts"
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="GIB",
        help="the memory of one GPU (default: this machine's first GPU; 80 for an H100)",
    )
    p.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        help="suggest the trainer/rollout GPU split and max_staleness from this run's measured "
        "phase times (its metrics.jsonl), with the device_mapping lines to paste",
    )
    p.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="with --from-run: the GPUs to split (default: the run's, or this machine's)",
    )
    p = workflow_command(
        "eval", cmd_eval, "score a checkpoint on the workflow's held-out datasets, no training"
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH|latest",
        help="RUN_DIR/checkpoint-N, or 'latest': the newest of trainer.output_dir",
    )
    p.add_argument(
        "--out", metavar="FILE", help="the JSON report (default: RUN_DIR/eval/checkpoint-N.json)"
    )
    p = sub.add_parser("plugins", help="installed plugins, their strategies and hooks")
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")
    p.add_argument(
        "--config",
        metavar="STRATEGY",
        help="the strategy_config keys of STRATEGY (any installed strategy): each key's type, "
        "default and description, a nested section's keys indented",
    )
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
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: also write the merged model (the adapter goes to OUT/adapter)",
    )
    p.set_defaults(handler=cmd_export_hf)
    p = sub.add_parser("stacks", help="the Python stacks of every process of a live run")
    p.add_argument("run_dir", help="the run's directory (trainer.output_dir)")
    p.add_argument("--all-threads", action="store_true", help="every thread, not just the main")
    p.set_defaults(handler=cmd_stacks)
    add_sandbox_parser(sub)
    host.hook.posttrain_add_cli_commands(subparsers=sub)
    return parser


def _show_warnings(err: Console, caught: list[warnings.WarningMessage]) -> None:
    """Plugin warnings as the CLI's own (like a plugin that failed to load); others as Python
    would have shown them."""
    from rich.markup import escape

    for w in caught:
        if issubclass(w.category, PluginWarning):
            err.print(f"[yellow]warning[/yellow]: {escape(str(w.message))}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _without_tracebacks(text: str) -> str:
    """A rank's report without its Python tracebacks (the exception's own line is kept): a
    failed rank is not the user's bug, and the traceback stays in the rank's log."""
    kept: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        if line.startswith("Traceback (most recent call last):"):
            inside = True
        elif inside and not line[:1].isspace():
            inside = False
        if not inside:
            kept.append(line)
    return "".join(kept)


def main(argv: list[str] | None = None) -> int:
    from rich.markup import escape  # messages may hold brackets: pip install './x[cpu]'

    err = _console(stderr=True)
    _stop_on_signals()
    try:
        from posttrain.host.plugin_host import create_plugin_host

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default", PluginWarning)
            host = create_plugin_host()
        _show_warnings(err, caught)
        for info in host.failures:
            err.print(
                f"[yellow]warning[/yellow]: plugin '{info.name}' failed to load: "
                f"{escape(info.error)}"
            )
        args = build_parser(host).parse_args(argv)
        return args.handler(args, host)
    except UserError as exc:
        err.print(f"[red]error[/red]: {escape(str(exc))}")
        return EXIT_USER
    except WorkerError as exc:
        err.print(f"[red]error[/red]: {escape(str(exc))}")
        if exc.user_error:  # the rank's traceback stays in its log
            if exc.hint:
                err.print(exc.hint, markup=False, highlight=False)
            return EXIT_USER
        detail = _without_tracebacks(exc.remote_traceback)
        if detail.strip():
            err.print(detail.rstrip(), markup=False, highlight=False)
        if detail != exc.remote_traceback:
            err.print("(the rank's Python traceback is in its log, under RUN_DIR/logs/)")
        if exc.hint:
            err.print(exc.hint, markup=False, highlight=False)
        return EXIT_INTERNAL
    except KeyboardInterrupt as exc:
        err.print(f"interrupted {exc}".strip(), markup=False)
        return 130
    except Exception:
        traceback.print_exc()
        return EXIT_INTERNAL


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM stop a command as Ctrl-C in a terminal does (a run: its ranks stopped
    in order, its checkpoints intact, the rerun line). Installed here, not left to Python: a
    process started with ``&`` from a script inherits SIGINT ignored, and Python then installs
    no handler of its own; SIGTERM is what schedulers (SLURM, Kubernetes) send."""
    if threading.current_thread() is not threading.main_thread():
        return  # (called by a program's own thread: signals are its main thread's)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
