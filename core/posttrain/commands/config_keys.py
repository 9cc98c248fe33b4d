"""The keys of an attrs config class, each with its type, default and description: what
docs/config-reference.md tabulates (:mod:`posttrain.config_reference`) and what
``posttrain plugins --config NAME`` prints of a strategy's ``strategy_config``.

A key's description is its ``metadata["help"]`` if set, else the comment lines just above it plus
the comment at the end of its line, read from the source of the class that declares it (inherited
fields included). Each text is markdown for the reference, plain for the terminal
(``markdown=False``).
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
import types
import typing
from typing import Any

import attrs

from posttrain.config.ranges import range_of


def field_comments(cls: type) -> dict[str, str]:
    """Comments attached to each field of ``cls``, inherited fields included (from the class
    that declares them last, as attrs takes the field)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if attrs.has(klass):
            out.update(_own_field_comments(klass))
    return out


def _own_field_comments(cls: type) -> dict[str, str]:
    """Comments attached to each field declared in ``cls``'s body, in its source file."""
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    node = next(
        (
            n
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ClassDef) and n.name == cls.__name__
        ),
        None,
    )
    if node is None:
        return {}
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        trailing = [
            comments[n]
            for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            if n in comments
        ]
        text = " ".join(above + trailing)
        if text:
            out[stmt.target.id] = text
    return out


def _code(text: str, markdown: bool) -> str:
    return f"`{text}`" if markdown else text


def type_text(tp: Any, markdown: bool = True) -> str:
    """``integer``, ``list of string``, ``one of: `a`, `b```; an attrs class is a link to its
    section of the reference (markdown) or its name."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if tp == tuple[int, ...]:
        return (
            f"device list: {_code('[0, 1]', markdown)} or "
            f"{_code('list(range(a, b[, step]))', markdown)}"
        )
    if attrs.has(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})" if markdown else tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of: " + ", ".join(
            _code(str(a).lower() if isinstance(a, bool) else str(a), markdown) for a in args
        )
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a, markdown) for a in args)
    if origin is list:
        return f"list of {type_text(args[0], markdown)}"
    if origin is dict:
        return "mapping"
    if isinstance(tp, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            tp.__name__, tp.__name__
        )
    return str(tp)


def range_text(field: attrs.Attribute) -> str:
    """``, >= 1`` when the field declares a range, else nothing."""
    allowed = range_of(field)
    return f", {allowed.describe()}" if allowed else ""


def _value_text(value: Any, markdown: bool) -> str:
    if value is None:
        return _code("null", markdown)
    if isinstance(value, bool):
        return _code("true" if value else "false", markdown)
    if isinstance(value, str):
        return _code(f'"{value}"', markdown)
    if isinstance(value, tuple | list):
        return _code("[" + ", ".join(_value_text(v, False) for v in value) + "]", markdown)
    if isinstance(value, dict):
        return _code("{}" if not value else repr(value), markdown)
    if attrs.has(type(value)):
        return "defaults of each key"
    return _code(repr(value), markdown)


# The plain default texts that are words, not a value.
NO_VALUE = ("required", "computed", "defaults of each key")


def default_text(field: attrs.Attribute, markdown: bool = True) -> str:
    """The field's default as YAML would write it; ``required`` when it has none, ``computed``
    when it is computed from the other fields."""
    default = field.default
    if default is attrs.NOTHING:
        return "**required**" if markdown else "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        factory: Any = default  # attrs' stubs declare Factory a function: no narrowing
        if factory.takes_self:
            return "computed"
        return _value_text(factory.factory(), markdown)
    return _value_text(default, markdown)


def nested_classes(tp: Any) -> list[type]:
    """The attrs classes in a field's type (``X``, ``X | None``, ``list[X]``)."""
    if attrs.has(tp):
        return [tp]
    return [c for a in typing.get_args(tp) for c in nested_classes(a)]


@attrs.frozen(kw_only=True)
class ConfigKey:
    """One key of a config class, as ``posttrain plugins --config`` shows it; ``keys`` are those
    of the attrs classes its value is made of (empty for a plain value)."""

    key: str
    type: str
    default: str
    doc: str
    keys: tuple[ConfigKey, ...] = ()


def config_keys(cls: type) -> tuple[ConfigKey, ...]:
    """Every key of the attrs class ``cls`` (inherited ones included, in attrs' order), with the
    keys of a nested attrs class under its own; a nested key without a comment is described by
    the first paragraph of its class's docstring."""
    return _keys(cls, (cls,))


def _keys(cls: type, seen: tuple[type, ...]) -> tuple[ConfigKey, ...]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out = []
    for field in attrs.fields(cls):
        # A class that contains itself (a tree of options) is listed once, not without end.
        # A value of one of several classes shows no keys: whose they are would be unclear.
        inner = [c for c in nested_classes(hints[field.name]) if c not in seen]
        inner = inner if len(inner) == 1 else []
        doc = field.metadata.get("help") or comments.get(field.name, "")
        if not doc and inner:
            doc = (inspect.getdoc(inner[0]) or "").split("\n\n")[0].replace("\n", " ")
        out.append(
            ConfigKey(
                key=field.name,
                type=type_text(hints[field.name], markdown=False) + range_text(field),
                default=default_text(field, markdown=False),
                doc=doc.replace("``", "`"),
                keys=tuple(k for c in inner for k in _keys(c, (*seen, c))),
            )
        )
    return tuple(out)
