"""The conformance kit's check of declared capabilities against implemented hooks: silent on the
installed strategies, failing (not skipping) on a strategy that declares one thing and does
another."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap
from types import SimpleNamespace

import attrs
import pytest

from posttrain import hookimpl
from posttrain.config.sections import ModelArgs
from posttrain.host.plugin_host import ENTRY_POINT_GROUP, create_plugin_host
from posttrain.host.strategy import Capabilities, StrategySpec
from posttrain.launch.worker import WorkerContext
from posttrain.testing import StrategyContract
from posttrain.testing.capabilities import (
    USES,
    Implemented,
    check_capabilities,
    implemented,
    mismatches,
)


@attrs.frozen(kw_only=True)
class NoConfig:
    pass


def _spec(name: str = "contract_mine", **capabilities) -> StrategySpec:
    return StrategySpec(name=name, config_class=NoConfig, capabilities=Capabilities(**capabilities))


def _implementing(*functions: str, unknown: tuple[str, ...] = (), sharing=()) -> Implemented:
    answers = {u.function: u.function in functions for u in USES}
    answers.update(dict.fromkeys(unknown))
    return Implemented(answers, tuple(sharing))


LIFECYCLE = ("release_memory", "resume_memory", "shutdown_worker")
BASICS = ("setup_parallel", "load_model", "compute_logprobs", *LIFECYCLE)
ROLLOUT = (*BASICS, "generate", "import_weights")
TRAIN = (*BASICS, "train_step", "export_weights", "save_checkpoint", "load_checkpoint", "export_hf")


def test_the_installed_strategies_declare_what_they_implement():
    host = create_plugin_host()
    assert "hf_infer" in host.strategies()
    for spec in host.strategies().values():
        assert check_capabilities(spec, host) == [], spec.name


def test_consistent_declarations_pass():
    assert mismatches(_spec(kind="rollout"), _implementing(*ROLLOUT)) == []
    assert mismatches(_spec(kind="infer"), _implementing(*BASICS)) == []
    critic = _spec(kind="train", heads=("lm", "value"))
    assert mismatches(critic, _implementing(*TRAIN, "compute_values")) == []


def test_an_engine_that_generates_declared_infer_is_told_to_declare_rollout():
    problems = mismatches(_spec(kind="infer"), _implementing(*ROLLOUT))
    assert problems == [
        f"contract_mine implements {f} but declares kind='infer'; the core calls it only for a "
        "kind='rollout' strategy, which contract_mine is not: it is never called and the "
        f"conformance kit does not test it; declare kind='rollout', or remove {f}"
        for f in ("generate", "import_weights")
    ]


def test_a_rollout_strategy_without_generate_is_named():
    (problem,) = mismatches(_spec(kind="rollout"), _implementing(*BASICS, "import_weights"))
    assert problem == (
        "contract_mine implements no generate (engine function generate, hook "
        "posttrain_generate), which the core calls for a kind='rollout' strategy; it declares "
        "kind='rollout': implement it, or change that"
    )


def test_undeclared_logprobs_values_and_scores_are_named():
    spec = _spec(kind="train", computes_logprobs=False)
    problems = mismatches(spec, _implementing(*TRAIN, "compute_values", "compute_scores"))
    assert len(problems) == 3, problems
    logprobs, values, scores = problems
    assert "implements compute_logprobs but declares computes_logprobs=False" in logprobs
    assert logprobs.endswith("set computes_logprobs=True, or remove compute_logprobs")
    assert "implements compute_values but declares kind='train', heads=('lm',)" in values
    assert "for a critic, declare kind='train' with 'value' in heads" in values
    assert "implements compute_scores but declares kind='train', heads=('lm',)" in scores


def test_a_declared_head_without_its_hook_is_named():
    (problem,) = mismatches(_spec(kind="infer", heads=("lm", "score")), _implementing(*BASICS))
    assert "implements no compute_scores" in problem
    assert "a reward model" in problem


def test_functions_of_a_shared_engine_module_are_accounted_for_by_its_other_strategies():
    """fsdp2_infer's engine module holds fsdp2_train's train_step: not a mismatch. Declared by
    none of the strategies it serves, a function still is one."""
    trainer = _spec("contract_trainer", kind="train", heads=("lm", "value"))
    infer = _spec(kind="infer")
    engine = _implementing(*TRAIN, "compute_values", sharing=(infer, trainer))
    assert mismatches(infer, engine) == []
    engine = _implementing(*TRAIN, "generate", sharing=(infer, trainer))
    (problem,) = mismatches(infer, engine)
    assert "nor contract_trainer (sharing its engine module)" in problem


def test_what_cannot_be_told_is_not_judged():
    unknown = ("generate", "import_weights", "compute_logprobs")
    assert mismatches(_spec(kind="infer"), _implementing(*BASICS, unknown=unknown)) == []
    assert mismatches(_spec(kind="rollout"), _implementing(*BASICS, unknown=unknown)) == []


MISMATCHED_PLUGIN = "posttrain_contract_mismatched_plugin"


@pytest.fixture
def mismatched_entry_point(tmp_path, monkeypatch):
    """An installed plugin (entry point) whose engine generates and imports weights but whose
    strategy is declared kind='infer', as a user of the guide might."""
    (tmp_path / f"{MISMATCHED_PLUGIN}.py").write_text(
        textwrap.dedent(
            """\
            import attrs
            from posttrain import hookimpl
            from posttrain.host.engine_hooks import EngineHooks
            from posttrain.host.strategy import Capabilities, StrategySpec

            @attrs.frozen(kw_only=True)
            class Config:
                pass

            class Plugin(EngineHooks):
                strategies = ("contract_my_engine",)
                engine = "posttrain_contract_mismatched_engine"

                @hookimpl
                def posttrain_add_strategies(self):
                    return [StrategySpec(name="contract_my_engine", config_class=Config,
                                         capabilities=Capabilities(kind="infer"))]

            plugin = Plugin()
            """
        )
    )
    (tmp_path / "posttrain_contract_mismatched_engine.py").write_text(
        textwrap.dedent(
            """\
            import torch  # never imported by the check


            def setup_parallel(worker): ...
            def load_model(worker): ...
            def compute_logprobs(worker, batch): ...
            def generate(worker, request): ...
            def import_weights(worker, buckets): ...
            def release_memory(worker, tags): ...
            def resume_memory(worker, tags): ...
            def shutdown_worker(worker): ...
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = importlib.metadata.EntryPoints(
        [
            importlib.metadata.EntryPoint(
                "mismatched", f"{MISMATCHED_PLUGIN}:plugin", ENTRY_POINT_GROUP
            )
        ]
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **params: eps)
    monkeypatch.delenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("POSTTRAIN_PLUGINS", raising=False)
    yield
    sys.modules.pop(MISMATCHED_PLUGIN, None)


def test_the_kit_fails_a_strategy_whose_declaration_hides_its_hooks(mismatched_entry_point):
    class TestMyEngine(StrategyContract):
        strategy = "contract_my_engine"

    spec = create_plugin_host().strategies()["contract_my_engine"]
    never_started = SimpleNamespace(getfixturevalue=lambda name: pytest.fail(f"started {name}"))
    with pytest.raises(pytest.fail.Exception) as failed:
        TestMyEngine().test_declared_capabilities_match_implemented_hooks(
            (spec, NoConfig()), never_started
        )
    lines = str(failed.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("contract_my_engine implements generate but declares kind='infer'")
    assert lines[1].startswith("contract_my_engine implements import_weights")
    assert lines[0].endswith("declare kind='rollout', or remove generate")
    assert "posttrain_contract_mismatched_engine" not in sys.modules


HAND_WRITTEN = "contract_hand_written"


class HandWrittenPlugin:
    """Hooks written by hand: only calling them on a rank tells which answer."""

    @hookimpl
    def posttrain_add_strategies(self):
        return [_spec(HAND_WRITTEN, kind="infer")]

    @hookimpl
    def posttrain_setup_parallel(self, worker):
        return {"dp_rank": 0, "dp_size": 1} if worker.strategy_name == HAND_WRITTEN else None

    @hookimpl
    def posttrain_load_model(self, worker):
        return "model" if worker.strategy_name == HAND_WRITTEN else None

    @hookimpl
    def posttrain_compute_logprobs(self, worker, batch):
        return "log-probs" if worker.strategy_name == HAND_WRITTEN else None

    @hookimpl
    def posttrain_generate(self, worker, request):
        return "samples" if worker.strategy_name == HAND_WRITTEN else None

    @hookimpl
    def posttrain_release_memory(self, worker, tags):
        return True if worker.strategy_name == HAND_WRITTEN else None

    @hookimpl
    def posttrain_resume_memory(self, worker, tags):
        return True if worker.strategy_name == HAND_WRITTEN else None

    @hookimpl
    def posttrain_shutdown_worker(self, worker):
        return True if worker.strategy_name == HAND_WRITTEN else None


def test_hand_written_hooks_are_judged_by_calling_them_on_a_rank(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    host = create_plugin_host(extra_plugins=[HandWrittenPlugin()])
    spec = host.strategies()[HAND_WRITTEN]
    rank = SimpleNamespace(
        ctx=WorkerContext(
            role="reference",
            strategy_name=HAND_WRITTEN,
            config=NoConfig(),
            model_args=ModelArgs(),
            hook=host.hook,
        )
    )
    calls = []

    class InProcessGroup:
        """Runs ``run_function`` as a rank does, on the rank stand-in above."""

        def call(self, method, path, *args):
            calls.append(method)
            module, _, name = path.partition(":")
            return [getattr(importlib.import_module(module), name)(rank, *args)]

    assert check_capabilities(spec, host) == []  # without a rank, nothing to judge by
    (problem,) = check_capabilities(spec, host, start=InProcessGroup)
    assert problem.startswith(f"{HAND_WRITTEN} implements generate but declares kind='infer'")
    assert calls == ["run_function"]


def test_a_wrapper_is_not_an_implementation(monkeypatch):
    """A timing wrapper around train_step leaves hf_infer without one (not 'cannot tell')."""

    class Timer:
        @hookimpl(wrapper=True)
        def posttrain_train_step(self, worker, batch, loss_fn):
            return (yield)

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    host = create_plugin_host(extra_plugins=[Timer()])
    answers = implemented(host, "hf_infer").answers
    assert answers["train_step"] is False and answers["generate"] is True
