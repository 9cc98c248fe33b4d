"""The ``calculator`` environment: one tool that evaluates integer arithmetic.

Its grammar is deliberately small (digits, ``+``, ``-``, ``*`` and spaces; ``*`` binds tighter;
a number may carry a leading minus), parsed by hand: nothing the model writes is ever given to
``eval``. Anything else (a division, letters, an expression longer than ``max_length``) is
answered with an error result, not an exception.
"""

from __future__ import annotations

import re
from typing import Literal

import attrs

from posttrain.config.ranges import at_least
from posttrain.rollout.environments.tools import Tool, ToolEnvironment, ToolError

_TOKEN = re.compile(r"\d+|[-+*]|\S")


@attrs.frozen(kw_only=True)
class CalculatorConfig:
    """``environment.kwargs`` of ``calculator``."""

    # compact: `<call>3+4</call>` answered with `<result>7</result>` (tiny local models);
    # hermes: `<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>`
    # answered with a tool message (Qwen2.5 and Hermes chat models); llama3_json: a turn that is
    # only `{"name": "calculator", "parameters": {"expression": "3+4"}}` (Llama-3.1).
    syntax: Literal["compact", "hermes", "llama3_json"] = "compact"
    # Longest expression evaluated, in characters; longer ones get an error result.
    max_length: int = attrs.field(default=32, validator=at_least(1))
    # Append the call syntax and the tool's documentation to the prompt.
    announce: bool = False


def evaluate(expression: str, max_length: int = 32) -> int:
    """The integer value of ``expression``; :class:`ToolError` for anything off the grammar."""
    if len(expression) > max_length:
        raise ToolError(f"longer than {max_length} characters")
    tokens = _TOKEN.findall(expression)
    if not tokens:
        raise ToolError("empty expression")
    position = 0

    def number() -> int:
        nonlocal position
        sign = 1
        if position < len(tokens) and tokens[position] == "-":
            sign, position = -1, position + 1
        if position >= len(tokens) or not tokens[position].isdigit():
            found = tokens[position] if position < len(tokens) else "the end"
            raise ToolError(f"expected a number, found {found!r}")
        position += 1
        return sign * int(tokens[position - 1])

    def product() -> int:
        nonlocal position
        value = number()
        while position < len(tokens) and tokens[position] == "*":
            position += 1
            value *= number()
        return value

    value = product()
    while position < len(tokens) and tokens[position] in ("+", "-"):
        operator = tokens[position]
        position += 1
        value = value + product() if operator == "+" else value - product()
    if position < len(tokens):
        raise ToolError(f"unexpected {tokens[position]!r}")
    return value


def calculator_environment(config: CalculatorConfig) -> ToolEnvironment:
    def calculator(expression: str) -> int:
        return evaluate(expression, config.max_length)

    tool = Tool(
        name="calculator",
        function=calculator,
        doc="expression: integers with + - * (no division)",
        parameters={
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. 12*3+4"},
            },
            "required": ["expression"],
        },
    )
    return ToolEnvironment([tool], syntax=config.syntax, announce=config.announce)
