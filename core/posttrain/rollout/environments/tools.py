"""Tools: Python functions the model calls with a documented syntax, as an environment.

A :class:`ToolEnvironment` reads each model turn. A turn that makes a call gets the tool's result
back as the observation; a turn without a call is the final answer, which the workflow's
``reward.function`` scores (``EnvStep.answer``) and which ends the episode. Mistakes of the
model (a malformed call, an unknown tool, arguments the tool rejects with :class:`ToolError`)
are answered with an error result and the episode goes on: the model may learn from them. A tool
that raises anything else is a broken environment: its episode ends with reward 0.

Three call syntaxes:

* ``hermes``, what Qwen2.5 and Hermes chat models emit:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>``,
  answered with a tool message holding the result (through the tokenizer's chat template). The
  tools' JSON schemas go to the chat template (``tools=``) when prompts are rendered, so a
  template that announces tools (Qwen2.5's) tells the model about them in its own words;
* ``llama3_json``, Llama-3.1's JSON tool calls: a turn that is only
  ``{"name": "calculator", "parameters": {"expression": "3+4"}}``, ended by the model's
  end-of-turn token (no stop string), answered with a tool message (Llama-3.1's ``ipython``
  message); the tools' schemas go to the chat template as with ``hermes``. Calls of Llama's
  built-in tools (``<|python_tag|>`` code) are not read;
* ``compact``, for tiny local models: ``<call>3+4</call>`` answered with ``<result>7</result>``
  in the model's own turn. With one tool its name is implicit; with several the call starts
  with it (``<call>calculator 3+4</call>``). The text of the call is the tool's one argument.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.rollout.environments.protocol import (
    EnvironmentSpec,
    EnvStep,
    ModelTurn,
    ObservationRole,
)

if TYPE_CHECKING:
    from posttrain.rollout.environments.protocol import EpisodePrompt


class ToolError(Exception):
    """A tool's answer to a call it cannot serve (bad arguments): the model sees an error
    result and the episode goes on."""


@attrs.frozen(kw_only=True)
class Tool:
    name: str
    function: Callable[..., Any]
    # One line on the arguments, for the tools' documentation: "expression: digits with + - *".
    doc: str
    # JSON schema of the keyword arguments (hermes), for the chat template's tool list; None:
    # every parameter of ``function`` as a string, required unless it has a default.
    parameters: dict[str, Any] | None = None

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (``apply_chat_template(tools=[...])``)."""
        parameters = self.parameters
        if parameters is None:
            signature = inspect.signature(self.function).parameters.values()
            parameters = {
                "type": "object",
                "properties": {p.name: {"type": "string"} for p in signature},
                "required": [p.name for p in signature if p.default is inspect.Parameter.empty],
            }
        function = {"name": self.name, "description": self.doc, "parameters": parameters}
        return {"type": "function", "function": function}


@attrs.frozen(kw_only=True)
class ToolCall:
    tool: Tool
    # hermes, llama3_json: keyword arguments; compact: the call's text, the one positional
    # argument.
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class CallSyntax:
    """How calls are written and how results come back."""

    open: str
    close: str  # ends a call turn: the environment's stop string ("": none)
    role: ObservationRole
    result_format: str  # with {value}
    error_format: str  # with {message}
    parse: Callable[[str, dict[str, Tool]], ToolCall]  # the call's text -> a call, or ToolError
    usage: str
    # The chat template's own call format: its tool list is given the tools' schemas.
    templated: bool = False
    # The call is the turn's whole text, which starts with ``open`` (Llama-3.1's JSON turn);
    # the model's end-of-turn token ends it.
    whole_turn: bool = False

    def find(self, text: str, tools: dict[str, Tool]) -> ToolCall | None:
        """The turn's first call; None when it makes none (a final answer)."""
        if self.whole_turn:
            body = text.strip()
            return self.parse(body, tools) if body.startswith(self.open) else None
        start = text.find(self.open)
        if start < 0:
            return None
        end = text.find(self.close, start + len(self.open))
        if end < 0:
            raise ToolError(f"the call is not closed with {self.close}")
        return self.parse(text[start + len(self.open) : end], tools)


def _parse_compact(body: str, tools: dict[str, Tool]) -> ToolCall:
    if len(tools) == 1:
        return ToolCall(tool=next(iter(tools.values())), args=(body.strip(),))
    name, _, rest = body.strip().partition(" ")
    if name not in tools:
        raise ToolError(f"unknown tool {name!r}")
    return ToolCall(tool=tools[name], args=(rest.strip(),))


def _parse_json_call(body: str, tools: dict[str, Tool], key: str) -> ToolCall:
    """``{"name": ..., key: {...}}``: hermes names the arguments "arguments", Llama-3.1
    "parameters"."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolError(f"the call is not JSON ({exc.msg})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError(f'a call is {{"name": ..., "{key}": {{...}}}}')
    if call["name"] not in tools:
        raise ToolError(f"unknown tool {call['name']!r}")
    arguments = call.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolError("the arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolError("the arguments are not a mapping")
    return ToolCall(tool=tools[call["name"]], kwargs=arguments)


SYNTAXES = {
    "hermes": CallSyntax(
        open="<tool_call>",
        close="</tool_call>",
        role="tool",
        result_format="{value}",
        error_format="error: {message}",
        parse=functools.partial(_parse_json_call, key="arguments"),
        templated=True,
        usage='Call a tool with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
        "its result comes back as a tool message. Answer without a call when done.",
    ),
    "llama3_json": CallSyntax(
        open="{",
        close="",
        role="tool",
        result_format="{value}",
        error_format="error: {message}",
        parse=functools.partial(_parse_json_call, key="parameters"),
        templated=True,
        whole_turn=True,
        usage='Call a tool with a turn that is only {"name": NAME, "parameters": {...}}; its '
        "result comes back as a tool message. Answer without a call when done.",
    ),
    "compact": CallSyntax(
        open="<call>",
        close="</call>",
        role=None,
        result_format="<result>{value}</result>",
        # Terse on purpose: tiny models read it with a small alphabet.
        error_format="<result>error</result>",
        parse=_parse_compact,
        usage="Call a tool with <call>ARGUMENT</call>; its result comes back as "
        "<result>VALUE</result>. Answer without a call when done.",
    ),
}


def syntax_stop_strings(syntax: str) -> tuple[str, ...]:
    """A call turn ends where its call is closed (a whole-turn call: at the end of the turn)."""
    close = SYNTAXES[syntax].close
    return (close,) if close else ()


class ToolEnvironment:
    """An environment of tools (see the module docstring); one per episode."""

    def __init__(self, tools: Sequence[Tool], syntax: str = "compact", announce: bool = False):
        if syntax not in SYNTAXES:
            raise ValueError(f"unknown call syntax {syntax!r} (known: {', '.join(SYNTAXES)})")
        self.tools = {tool.name: tool for tool in tools}
        self.syntax = SYNTAXES[syntax]
        self.announce = announce

    def instructions(self) -> str:
        """The call syntax and one line per tool."""
        lines = [self.syntax.usage] + [f"{t.name}({t.doc})" for t in self.tools.values()]
        return "\n".join(lines) + "\n"

    def schemas(self) -> list[dict[str, Any]]:
        """The tools for the chat template's tool list; none when the syntax is not the
        template's (compact calls would contradict what the template tells the model)."""
        return [tool.schema() for tool in self.tools.values()] if self.syntax.templated else []

    def reset(self, prompt: EpisodePrompt) -> str | None:
        return self.instructions() if self.announce else None

    def step(self, turn: ModelTurn) -> EnvStep:
        syntax = self.syntax
        try:
            call = syntax.find(turn.text, self.tools)
            if call is None:
                return EnvStep(done=True, answer=turn.text.strip())
            value = self._invoke(call)
        except ToolError as exc:
            return EnvStep(observation=syntax.error_format.format(message=exc), role=syntax.role)
        return EnvStep(
            observation=syntax.result_format.format(value=value), tool_calls=1, role=syntax.role
        )

    @staticmethod
    def _invoke(call: ToolCall) -> Any:
        try:
            inspect.signature(call.tool.function).bind(*call.args, **call.kwargs)
        except TypeError as exc:  # the model's arguments do not fit the function
            raise ToolError(f"bad arguments for {call.tool.name}: {exc}") from None
        return call.tool.function(*call.args, **call.kwargs)


def tool_environment_spec(
    factory: Callable[[Any], ToolEnvironment], config_class: type, description: str
) -> EnvironmentSpec:
    """The spec of a tool environment whose config has a ``syntax`` field (its stop string)."""
    return EnvironmentSpec(
        factory=factory,
        config_class=config_class,
        stop_strings=lambda config: syntax_stop_strings(config.syntax),
        tools=lambda config: factory(config).schemas(),
        description=description,
    )
