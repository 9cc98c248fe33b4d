"""Loggers as a registry (``posttrain_add_loggers``): the built-ins, a plugin's logger with its
typed options, and every mistake in ``trainer.logger`` / ``trainer.logger_args`` reported at
once, before anything starts."""

from __future__ import annotations

import attrs
import pytest

from posttrain import LoggerContext, LoggerSpec, UserError, hookimpl
from posttrain.config.report import ErrorReport
from posttrain.loading.workflow import build_workflow
from posttrain.trainer.logger_registry import logger_specs, make_loggers


@attrs.frozen(kw_only=True)
class ListOptions:
    prefix: str = ""
    every: int = 1


class ListLogger:
    """Keeps what it receives in memory, with its options' prefix."""

    def __init__(self, context: LoggerContext):
        self.context = context
        self.seen: list[tuple[int, dict]] = []

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        self.seen.append((step, {self.context.options.prefix + k: v for k, v in metrics.items()}))


class ListPlugin:
    @hookimpl
    def posttrain_add_loggers(self):
        return {"memory": LoggerSpec(factory=ListLogger, config_class=ListOptions)}


@pytest.fixture
def host(fake_train_host):
    fake_train_host.pm.register(ListPlugin(), name="list-plugin")
    return fake_train_host


def build(host, model_dir, tmp_path, **trainer):
    raw = {
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "actor_train": {"strategy_args": {"strategy_name": "contract_fake_train"}},
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}},
        "trainer": {"output_dir": "runs/my-run", **trainer},
    }
    workflow, report = build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))
    return workflow, {e.path: e for e in report.errors}


def test_builtin_and_plugin_loggers_are_declared(host):
    specs = logger_specs(host.hook)
    assert {"console", "jsonl", "tensorboard", "memory"} <= set(specs)


def test_a_plugin_redeclaring_a_builtin_logger_is_a_conflict(host, model_dir, tmp_path):
    class Clash:
        @hookimpl
        def posttrain_add_loggers(self):
            return {"jsonl": LoggerSpec(factory=ListLogger)}

    host.pm.register(Clash(), name="clash")
    with pytest.raises(UserError, match="logger 'jsonl' is declared by two plugins"):
        logger_specs(host.hook)
    _, errors = build(host, model_dir, tmp_path)
    assert "declared by two plugins" in errors["plugins"].message


def test_logger_mistakes_are_reported_at_once(host, model_dir, tmp_path):
    _, errors = build(
        host,
        model_dir,
        tmp_path,
        logger=["consol", "wandb", "memory", "memory"],
        logger_args={"memory": {"prefx": "a/", "every": 0.5}, "jsonl": {}},
    )
    assert set(errors) == {
        "trainer.logger[0]",
        "trainer.logger[1]",
        "trainer.logger[3]",
        "trainer.logger_args.memory.prefx",
        "trainer.logger_args.memory.every",
        "trainer.logger_args.jsonl",
    }
    unknown = errors["trainer.logger[0]"]
    assert unknown.message == "unknown logger 'consol'"
    assert "did you mean 'console'?" in unknown.hint
    assert "installed loggers: console, jsonl, memory, tensorboard" in unknown.hint
    # A tracker the project ships elsewhere: the error says what to install.
    assert "'wandb' is provided by posttrain-trackers" in errors["trainer.logger[1]"].hint
    assert errors["trainer.logger[3]"].message == "logger 'memory' is named twice"
    assert "did you mean 'prefix'" in errors["trainer.logger_args.memory.prefx"].hint
    assert "trainer.logger does not name" in errors["trainer.logger_args.jsonl"].message


def test_a_plugin_logger_gets_its_typed_options_and_the_run(host, model_dir, tmp_path):
    workflow, errors = build(
        host, model_dir, tmp_path, logger=["jsonl", "memory"], logger_args={"memory": {"every": 2}}
    )
    assert errors == {}
    # Structured when the workflow is loaded (defaults filled): the record shows them.
    assert workflow.trainer.logger_args == {"memory": ListOptions(every=2)}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    loggers = dict(make_loggers(workflow, host.hook, None, str(run_dir), 3, set(), config={"a": 1}))
    assert list(loggers) == ["jsonl", "memory"]
    context = loggers["memory"].context
    assert (context.run_name, context.start_step, context.max_steps) == ("my-run", 3, 100)
    assert context.options == ListOptions(every=2) and context.config == {"a": 1}
    for name, logger in loggers.items():
        host.pm.register(logger, name=f"logger-{name}")
    host.hook.posttrain_log_metrics(step=4, metrics={"reward/mean": 0.5}, run_dir=str(run_dir))
    assert loggers["memory"].seen == [(4, {"reward/mean": 0.5})]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 4, "reward/mean": 0.5}\n'


def test_a_logger_that_cannot_start_is_a_user_error_naming_it(host, model_dir, tmp_path):
    def refuse(context):
        raise ConnectionError("no tracking server at http://nowhere")

    class Refusing:
        @hookimpl
        def posttrain_add_loggers(self):
            return {"remote": LoggerSpec(factory=refuse)}

    host.pm.register(Refusing(), name="refusing")
    workflow, errors = build(host, model_dir, tmp_path, logger=["remote"])
    assert errors == {}
    with pytest.raises(UserError, match="logger 'remote' failed to start: ConnectionError: no"):
        dict(make_loggers(workflow, host.hook, None, str(tmp_path), 0, set(), config={}))
