"""``echo_last_expression``: the program text it hands the sandbox, run here by the real
interpreter only for the rewrite's own checks (the environment test runs it in the sandbox)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from posttrain.sandbox.repl import echo_last_expression


def shown(code: str) -> str:
    """What the rewritten program prints, run as a script (as the sandbox runs it)."""
    done = subprocess.run(
        [sys.executable, "-c", echo_last_expression(code)], capture_output=True, text=True
    )
    return done.stdout + done.stderr


@pytest.mark.parametrize(
    ("code", "output"),
    [
        ("12+345+67", "424\n"),
        ("x = 2\nx * 3", "6\n"),
        ("x = [1, 2]\n(x +\n  [3])  # a comment\n", "[1, 2, 3]\n"),
        ("'a' * 2;", "'aa'\n"),  # the repr, as the interactive interpreter shows it
        ("print(5)", "5\n"),  # print returns None: nothing more is shown
        ("1\n2", "2\n"),  # only the last expression, as in a notebook cell
        ("s = 'é'; len(s) + 1", "2\n"),  # columns are UTF-8 bytes in the AST
        ("if True:\n    7", ""),  # not a top-level expression
        ("x = 1\r\nx + 1\r\n", "2\n"),
    ],
)
def test_the_last_bare_expression_is_shown(code, output):
    assert shown(code) == output


def test_other_programs_are_left_as_written():
    for code in ("x = 1", "", "# nothing", "1 +", "a = 1\x00"):
        assert echo_last_expression(code) == code


def test_line_numbers_of_a_traceback_are_the_programs():
    assert "line 2, in <module>" in shown("x = 1\n1/0\n")
    # A program that replaced the display hook is shown through it, as interactively.
    assert shown("import sys\nsys.displayhook = lambda v: print('got', v)\n3") == "got 3\n"
