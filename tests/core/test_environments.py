"""Environments as plugins: the registry and the workflow's checks, the calculator and its call
syntaxes, and observations through chat templates."""

from __future__ import annotations

import env_support
import pytest

from posttrain import hookimpl
from posttrain.config.report import ErrorReport
from posttrain.errors import UserError
from posttrain.host.plugin_host import create_plugin_host
from posttrain.loading.workflow import build_workflow
from posttrain.rollout.environments.calculator import (
    CalculatorConfig,
    calculator_environment,
    evaluate,
)
from posttrain.rollout.environments.observations import ObservationEncoder, message_delta
from posttrain.rollout.environments.protocol import EnvironmentSpec, ModelTurn
from posttrain.rollout.environments.registry import environment_specs
from posttrain.rollout.environments.tools import Tool, ToolEnvironment, ToolError

# -- registry and validation -------------------------------------------------------------------


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    host = create_plugin_host()
    host.pm.register(env_support, name="env-support")
    return host


def build(host, model_dir, tmp_path, environment: dict, **sections):
    raw = {
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "actor_train": {"strategy_args": {"strategy_name": "hf_infer"}},
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}},
        "environment": environment,
        **sections,
    }
    report = ErrorReport()
    workflow, _ = build_workflow(raw, host, report, base_dir=str(tmp_path))
    errors = [e for e in report.errors if e.path.startswith(("environment", "plugins", "reward"))]
    return workflow, errors


def test_environments_are_declared_by_plugins(host):
    specs = environment_specs(host.hook)
    assert {"calculator", "countdown", "broken"} <= set(specs)

    class Clash:
        @hookimpl
        def posttrain_add_environments(self):
            return {"countdown": EnvironmentSpec(factory=env_support.Countdown)}

    host.pm.register(Clash(), name="clash")
    with pytest.raises(UserError, match="'env-support' and 'clash'"):
        environment_specs(host.hook)


def test_the_environment_section_is_checked_all_at_once(host, model_dir, tmp_path):
    _, errors = build(
        host,
        model_dir,
        tmp_path,
        {
            "name": "calculater",
            "max_turns": 0,
            "step_timeout_s": 0,
            "reward": "step",
            "isolation": "fork",
            "processes": 0,
            "max_failed_steps": 0,
        },
    )
    by_path = {e.path: e for e in errors}
    assert set(by_path) == {
        "environment.name",
        "environment.max_turns",
        "environment.step_timeout_s",
        "environment.reward",
        "environment.isolation",
        "environment.processes",
        "environment.max_failed_steps",
    }
    assert "did you mean 'calculator'" in by_path["environment.name"].hint
    _, errors = build(host, model_dir, tmp_path, {"name": "calculator", "kwargs": {"syntx": "x"}})
    assert [(e.path, e.message) for e in errors] == [("environment.kwargs.syntx", "unknown key")]
    assert "did you mean 'syntax'" in errors[0].hint


def test_process_isolation_needs_an_environment_it_can_send(host, model_dir, tmp_path):
    class Local:
        @hookimpl
        def posttrain_add_environments(self):
            return {"local": EnvironmentSpec(factory=lambda config: env_support.Countdown(config))}

    host.pm.register(Local(), name="local")
    _, errors = build(host, model_dir, tmp_path, {"name": "local", "isolation": "process"})
    assert [e.path for e in errors] == ["environment.isolation"]
    assert "cannot be sent to a worker process" in errors[0].message
    assert "isolation: thread" in errors[0].hint
    # The same environment in threads, and a module-level one in processes, are fine.
    assert build(host, model_dir, tmp_path, {"name": "local"})[1] == []
    assert build(host, model_dir, tmp_path, {"name": "hostile", "isolation": "process"})[1] == []


def test_a_valid_environment_is_typed_and_stops_turns_where_calls_close(host, model_dir, tmp_path):
    # An environment needs no reward.function: it rewards on its own.
    workflow, errors = build(
        host,
        model_dir,
        tmp_path,
        {"name": "calculator", "kwargs": {"syntax": "hermes"}},
        reward={"function": None},
    )
    assert errors == []
    assert workflow.environment.kwargs == CalculatorConfig(syntax="hermes")
    assert workflow.actor_infer.generating_args.stop_strings == ["</tool_call>"]


def test_python_sandbox_validates_with_its_typed_config(host, model_dir, tmp_path):
    from posttrain.rollout.environments.python_sandbox import PythonSandboxConfig

    kwargs = {"syntax": "hermes", "isolation": "auto", "limits": {"timeout_s": 3}}
    workflow, errors = build(
        host, model_dir, tmp_path, {"name": "python_sandbox", "kwargs": kwargs}
    )
    assert errors == []
    assert isinstance(workflow.environment.kwargs, PythonSandboxConfig)
    assert workflow.environment.kwargs.limits.timeout_s == 3
    assert workflow.actor_infer.generating_args.stop_strings == ["</tool_call>"]
    _, errors = build(
        host,
        model_dir,
        tmp_path,
        {"name": "python_sandbox", "kwargs": {"limits": {"timout_s": 3, "memory_mb": 0}}},
    )
    assert {(e.path, e.message.split(";")[0]) for e in errors} == {
        ("environment.kwargs.limits.timout_s", "unknown key"),
        ("environment.kwargs.limits.memory_mb", "0 is out of range"),
    }


# -- the calculator and the call syntaxes ------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3+4", 7), ("2+3*4", 14), (" 12 - 30 ", -18), ("-3*-2", 6), ("7", 7), ("1-2-3", -4)],
)
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["8/2", "a+1", "3+", "", "2**3", "(1+2)", "1" * 33])
def test_calculator_refuses_everything_else(expression):
    with pytest.raises(ToolError):
        evaluate(expression)


def turn(text: str) -> ModelTurn:
    return ModelTurn(text=text, ids=(), index=0)


def test_compact_calls_are_answered_in_the_turn_and_a_turn_without_one_is_the_answer():
    env = calculator_environment(CalculatorConfig())
    step = env.step(turn("<call>3+4</call>"))
    assert (step.observation, step.tool_calls, step.role, step.done) == (
        "<result>7</result>",
        1,
        None,
        False,
    )
    for bad in ("<call>8/2</call>", "<call>3+4"):
        step = env.step(turn(bad))
        assert (step.observation, step.tool_calls, step.done) == (
            "<result>error</result>",
            0,
            False,
        )
    step = env.step(turn(" 7 "))
    assert step.done and step.answer == "7" and step.reward == 0


def test_hermes_calls_name_their_tool_and_pass_json_arguments():
    env = calculator_environment(CalculatorConfig(syntax="hermes"))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    step = env.step(turn("Let me compute. " + call))
    assert (step.observation, step.tool_calls, step.role) == ("42", 1, "tool")
    for bad, why in [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>', "bad arguments"),
    ]:
        step = env.step(turn(bad))
        assert step.tool_calls == 0 and why in step.observation and not step.done


def test_several_compact_tools_are_called_by_name_and_documented():
    tools = [
        Tool(name="add", function=lambda text: sum(map(int, text.split())), doc="numbers"),
        Tool(name="echo", function=lambda text: text, doc="text"),
    ]
    env = ToolEnvironment(tools, syntax="compact", announce=True)
    assert env.step(turn("<call>add 2 3</call>")).observation == "<result>5</result>"
    assert env.step(turn("<call>mul 2 3</call>")).observation == "<result>error</result>"
    assert env.reset(None) == env.instructions() and "add(numbers)" in env.instructions()


# -- observations ------------------------------------------------------------------------------

# ChatML with Qwen2.5's rendering of tool messages.
CHATML = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    from posttrain.tasks.presets import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def test_a_tool_message_is_what_the_template_adds_after_the_turn(chat_tokenizer):
    delta = "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
    delta += "<|im_start|>assistant\n"
    assert message_delta(chat_tokenizer, "7", "tool") == delta
    encoder = ObservationEncoder(chat_tokenizer)
    ids = encoder.text_ids(delta)
    digits = tuple(encoder.text_ids("3+4"))
    assert encoder.encode("7", "tool", digits) == ids
    # A turn the model closed itself keeps its end-of-turn token; the template's is dropped.
    closed = (*digits, chat_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert encoder.encode("7", "tool", closed) == ids[1:]
    # Text that continues the turn, and token ids, are appended as they are.
    assert encoder.encode("<result>7</result>", None, digits) == encoder.text_ids(
        "<result>7</result>"
    )
    assert encoder.encode([5, 6], "tool", digits) == [5, 6]


def test_a_template_that_cannot_render_the_role_is_a_clear_error(chat_tokenizer):
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tool role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(UserError, match="cannot render a 'tool' message"):
        message_delta(chat_tokenizer, "7", "tool")
