"""Notebook-cell semantics for a program: the value of a final bare expression is shown.

``12+345`` as a cell of Jupyter, or a line of Python's interactive mode, shows ``357``; as a
script it shows nothing. Code-interpreter tools commonly answer like the notebook, and a model
whose vocabulary has no letters can then still run real code. :func:`echo_last_expression`
rewrites the program's text so that, run as a plain script in the sandbox, it does the same:
the last statement, when it is an expression, is handed to ``sys.displayhook``, which is what
the interactive interpreter calls (it prints the value's ``repr`` unless it is ``None``).

The rewrite only parses the code (``ast.parse`` runs nothing); the program still runs only in
the sandbox. Every other line is kept as written, so a traceback's line numbers are the
model's.
"""

from __future__ import annotations

import ast

# Looked up at run time inside the program, so a program that replaced sys.displayhook is shown
# through its own hook, as in the interactive interpreter.
_DISPLAY = "__import__('sys').displayhook("


def echo_last_expression(code: str) -> str:
    """``code`` with its last top-level statement, if a bare expression, passed to
    ``sys.displayhook``; any other program (and one that does not parse, whose error the
    sandbox then reports as Python would) unchanged."""
    # Python reads a program's \r\n and \r as \n; the rewrite must count lines as it does.
    text = code.replace("\r\n", "\n").replace("\r", "\n")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # ValueError: a null byte; RecursionError/MemoryError: nesting past the parser's depth.
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    lines = text.split("\n")
    start = _index(lines, last.lineno, last.col_offset)
    end = _index(lines, last.end_lineno or last.lineno, last.end_col_offset or 0)
    # The parentheses let the expression keep its line breaks; what follows it on its last line
    # (a comment, a semicolon) stays after them.
    return f"{text[:start]}{_DISPLAY}({text[start:end]})){text[end:]}"


def _index(lines: list[str], lineno: int, col_offset: int) -> int:
    """The character index of an AST position (1-based line, column in UTF-8 bytes)."""
    before = sum(len(line) + 1 for line in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode("utf-8")[:col_offset].decode("utf-8"))
