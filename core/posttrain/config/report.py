"""Collects every configuration problem with its YAML path, so all are shown at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import attrs

from posttrain.errors import UserError


@attrs.frozen
class ConfigIssue:
    path: str
    message: str
    hint: str = ""

    def render(self) -> str:
        text = f"{self.path or '<workflow>'}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


@attrs.define
class ErrorReport:
    """Errors (fatal), warnings (a likely problem that does not stop a run, e.g. a hub model
    that is not downloaded yet) and notes (informational, e.g. checks skipped offline)."""

    errors: list[ConfigIssue] = attrs.field(factory=list)
    warnings: list[ConfigIssue] = attrs.field(factory=list)
    notes: list[ConfigIssue] = attrs.field(factory=list)
    # Sections present in the YAML that failed to structure (they hold defaults or None in the
    # Workflow): cross-field checks skip them instead of reporting a second, misleading error.
    failed_sections: set[str] = attrs.field(factory=set)

    def error(self, path: str, message: str, hint: str = "") -> None:
        issue = ConfigIssue(path, message, hint)
        if issue not in self.errors:
            self.errors.append(issue)

    def warn(self, path: str, message: str, hint: str = "") -> None:
        self.warnings.append(ConfigIssue(path, message, hint))

    def note(self, path: str, message: str) -> None:
        self.notes.append(ConfigIssue(path, message))

    def __bool__(self) -> bool:
        return bool(self.errors)

    def raise_if_errors(self, source: str = "workflow") -> None:
        if self.errors:
            raise WorkflowError(source, self.errors)


class WorkflowError(UserError):
    """Raised with every error found in a workflow."""

    def __init__(self, source: str, issues: list[ConfigIssue]):
        self.source = source
        self.issues = issues
        lines = [f"{source}: {len(issues)} error(s)"]
        lines += [f"  - {issue.render()}" for issue in issues]
        super().__init__("\n".join(lines))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A hint naming the closest choice, or listing the choices when none is close."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if len(choices) <= 12:
        return "expected one of: " + ", ".join(choices)
    return ""


def unknown_name_hint(
    name: str, installed: Iterable[str], noun: str, providers: dict[str, str]
) -> str:
    """The hint for a name no installed plugin declares (a strategy, a logger): the package that
    provides it when one is known (``providers``), or the closest installed name, then the
    installed ``noun``."""
    installed = sorted(set(installed))
    hint = f"installed {noun}: {', '.join(installed) or 'none'}"
    if name in providers:
        return f"'{name}' is provided by {providers[name]}; {hint}"
    close = did_you_mean(name, installed)
    return f"{close} {hint}" if close.startswith("did you mean") else hint


def unknown_keys(keys: Iterable[str], known: Iterable[str]) -> str:
    """``'a' (did you mean 'b'?), 'c'``: the keys, each with the closest known key if any (for
    mappings passed through to an engine, checked against what it accepts)."""
    known = sorted(set(known))
    hints = []
    for key in keys:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)


def join_path(*parts: str | int) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out = f"{out}.{part}" if out else str(part)
    return out
