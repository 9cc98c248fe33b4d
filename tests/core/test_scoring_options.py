"""``ScoringOptions``: the strategy_config fields core reads, declared once and read typed."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest

from posttrain import ScoringOptions, at_least
from posttrain.config.converter import structure_into
from posttrain.config.report import ErrorReport
from posttrain.config.scoring_options import NO_SCORING_OPTIONS, scoring_options

FIELDS = {f.name for f in attrs.fields(ScoringOptions)}


def _installed_config_classes() -> dict[str, type]:
    from posttrain.errors import PluginError
    from posttrain.host.plugin_host import create_plugin_host

    try:
        specs = create_plugin_host().strategies()
    except PluginError as exc:  # two installed plugins claim one strategy: not this test's case
        pytest.skip(str(exc))
    return {name: spec.config_class for name, spec in specs.items()}


def test_every_strategy_config_with_the_options_inherits_them():
    classes = _installed_config_classes()
    assert "hf_infer" in classes
    offering = {
        name: cls for name, cls in classes.items() if FIELDS & {f.name for f in attrs.fields(cls)}
    }
    assert "hf_infer" in offering
    for name, cls in offering.items():
        assert issubclass(cls, ScoringOptions), f"{name}: {cls.__name__} declares its own"
        # Inherited, not declared again (a subclass redeclares one only to change its default).
        redeclared = [f.name for f in attrs.fields(cls) if f.name in FIELDS and not f.inherited]
        assert redeclared == [], f"{name}: {cls.__name__} redeclares {redeclared}"


@attrs.frozen(kw_only=True)
class _EngineConfig(ScoringOptions):
    tensor_parallel_size: int = attrs.field(default=1, validator=at_least(1))


def test_inherited_fields_structure_with_ranges_and_did_you_mean():
    report = ErrorReport()
    config = structure_into(
        {"micro_batch_size": 2, "logprob_chunk_tokens": 0, "tensor_parallel_size": 2},
        _EngineConfig,
        "actor_train.strategy_args.strategy_config",
        report,
    )
    assert not report.errors
    assert config == _EngineConfig(
        micro_batch_size=2, logprob_chunk_tokens=0, tensor_parallel_size=2
    )

    report = ErrorReport()
    structure_into(
        {"logprob_chunk_token": 64, "logprob_micro_batch_size": 0},
        _EngineConfig,
        "ref.strategy_args.strategy_config",
        report,
    )
    text = "\n".join(e.render() for e in report.errors)
    assert "did you mean 'logprob_chunk_tokens'?" in text
    assert "ref.strategy_args.strategy_config.logprob_micro_batch_size" in text


def _worker(config, infer_batch_size=None, per_device=4):
    return SimpleNamespace(
        config=config,
        infer_batch_size=infer_batch_size,
        require_training_args=lambda: SimpleNamespace(per_device_train_batch_size=per_device),
    )


def test_core_reads_the_options_typed():
    from posttrain.backend import micro_batch_size

    config = _EngineConfig(micro_batch_size=3, logprob_micro_batch_size=5, logprob_chunk_tokens=7)
    assert scoring_options(_worker(config)) is config
    # A strategy without the options: row counts from the role, full-logit log-probs, as before.
    plain = SimpleNamespace(micro_batch_size=99, logprob_chunk_tokens=99)
    assert scoring_options(_worker(plain)) is NO_SCORING_OPTIONS
    assert NO_SCORING_OPTIONS.logprob_chunk_tokens == 0

    assert micro_batch_size(_worker(config), train=True, for_logprobs=False) == 3
    assert micro_batch_size(_worker(config), train=True, for_logprobs=True) == 5
    assert micro_batch_size(_worker(config), train=False, for_logprobs=True) == 5
    assert micro_batch_size(_worker(_EngineConfig()), train=True, for_logprobs=True) == 4
    assert micro_batch_size(_worker(_EngineConfig(), 6), train=False, for_logprobs=True) == 6
    assert micro_batch_size(_worker(plain), train=False, for_logprobs=True) == 8
