"""The ``python_sandbox`` environment: one tool, ``python``, that runs the model's code in a
sandbox and answers with what it printed.

Each call is a fresh program: nothing carries over between calls of an episode; with
``echo_last_expression`` a final bare expression's value is shown, as in a notebook cell
(:mod:`posttrain.sandbox.repl`). The observation
is its stdout, then its stderr, then a line when a limit ended it, cut to
``max_observation_chars``. The local backend runs it under :mod:`posttrain.sandbox.local`; the
remote one posts it to a SandboxFusion service (:mod:`posttrain.sandbox.remote`). A sandbox that
cannot run at all (bubblewrap gone, the service unreachable) is a broken environment: the
episode scores 0 and the error is logged, as for any environment that raises.
"""

from __future__ import annotations

from typing import Literal

import attrs

from posttrain.config.ranges import at_least
from posttrain.rollout.environments.tools import Tool, ToolEnvironment, ToolError
from posttrain.sandbox.repl import echo_last_expression
from posttrain.sandbox.result import SandboxLimits, SandboxResult, truncate


@attrs.frozen(kw_only=True)
class PythonSandboxConfig:
    """``environment.kwargs`` of ``python_sandbox``."""

    # compact: `<call>print(2+3)</call>` answered with `<result>5</result>`; hermes:
    # `<tool_call>{"name": "python", "arguments": {"code": "print(2+3)"}}</tool_call>`.
    syntax: Literal["compact", "hermes"] = "compact"
    # local: this machine's sandbox; remote: a SandboxFusion service at `url`.
    backend: Literal["local", "remote"] = "local"
    # local only. strict (or bubblewrap, the same): namespaces plus rlimits, refused where
    # bwrap cannot run; rlimits: limits only, the code sees this machine's files and network;
    # auto: the best this machine has, with a warning on stderr when that is rlimits.
    # docs/sandbox.md lists what each guarantees.
    isolation: Literal["bubblewrap", "strict", "rlimits", "auto"] = "bubblewrap"
    # The local interpreter; outside /usr its prefix is shown to the code, read-only.
    python: str = "/usr/bin/python3"
    # Host paths shown read-only at the same place under bubblewrap (e.g. a venv with numpy).
    read_only_paths: list[str] = attrs.field(factory=list)
    # remote only: the service, e.g. http://sandbox:8080 (POST /run_code).
    url: str | None = None
    # Time, memory, processes, files and output of each call (the table below).
    limits: SandboxLimits = attrs.field(factory=SandboxLimits)
    # Longest observation, in characters; the rest is cut and marked "...[truncated]".
    max_observation_chars: int = attrs.field(default=1024, validator=at_least(16))
    # Longest program the tool runs, in characters; longer ones get an error result.
    max_code_chars: int = attrs.field(default=8192, validator=at_least(1))
    # Notebook-cell semantics: a final bare expression's value is printed (its repr, unless
    # None), as Jupyter and Python's interactive mode show it, so `<call>12+345</call>` answers
    # `<result>357</result>`. The code still runs only in the sandbox (docs/sandbox.md).
    echo_last_expression: bool = False
    # Append the call syntax and the tool's documentation to the prompt.
    announce: bool = False

    def __attrs_post_init__(self) -> None:
        if self.backend == "remote" and not self.url:
            raise ValueError("backend 'remote' needs url: the SandboxFusion service's address")
        if self.backend == "local" and self.url:
            raise ValueError("url is set but backend is 'local'; set backend: remote to use it")
        if self.backend == "local":
            self._check_local()

    def _check_local(self) -> None:
        """The local sandbox must be able to run as configured, here (where episodes run)."""
        from posttrain.sandbox.local import (
            SandboxUnavailable,
            check_paths,
            resolve_level,
            warn_fallback_once,
        )

        try:
            level = resolve_level(self.isolation)
        except SandboxUnavailable as exc:
            raise ValueError(str(exc)) from None
        warn_fallback_once(self.isolation, level)
        problems = check_paths(self.python, self.read_only_paths, level)
        if problems:
            raise ValueError(
                "; ".join(problems) + " (python and read_only_paths must be readable by the "
                "sandbox's user: docs/sandbox.md)"
            )


def observation(result: SandboxResult, limit: int) -> str:
    """What the model reads of a run."""
    parts = [result.stdout, result.stderr]
    if result.timed_out:
        parts.append("timed out\n")
    elif result.killed_reason is not None:
        parts.append(f"stopped: {result.killed_reason} limit\n")
    return truncate("".join(p for p in parts if p).rstrip("\n"), limit)


def run_sandboxed(config: PythonSandboxConfig, code: str) -> SandboxResult:
    if config.echo_last_expression:
        code = echo_last_expression(code)
    if config.backend == "remote":
        from posttrain.sandbox.remote import run_remote

        return run_remote(code, config.limits, str(config.url))
    from posttrain.sandbox.local import run_python

    return run_python(
        code,
        config.limits,
        isolation=config.isolation,
        python=config.python,
        read_only_paths=tuple(config.read_only_paths),
    )


def python_sandbox_environment(config: PythonSandboxConfig) -> ToolEnvironment:
    def python(code: str) -> str:
        if not isinstance(code, str) or not code.strip():
            raise ToolError("no code to run")
        if len(code) > config.max_code_chars:
            raise ToolError(f"longer than {config.max_code_chars} characters")
        return observation(run_sandboxed(config, code), config.max_observation_chars)

    tool = Tool(name="python", function=python, doc="code: a Python program; prints are shown")
    return ToolEnvironment([tool], syntax=config.syntax, announce=config.announce)
