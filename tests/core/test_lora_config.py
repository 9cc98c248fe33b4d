"""``model_args.lora``: typed and range-checked, every mistake at once with its YAML path, and
refused on a trainer whose strategy does not train adapters (``Capabilities.lora``); what its
syncs carry (``lora.sync``) resolved before any process starts."""

from __future__ import annotations

import attrs

from posttrain.config.report import ErrorReport
from posttrain.host.strategy import Capabilities, StrategySpec
from posttrain.loading.workflow import build_workflow
from posttrain.markers import hookimpl

CONTRACT_FAKE_TRAIN = "contract_fake_train"  # declared by conftest's fake plugin; no lora


def _raw(model: str, lora: dict) -> dict:
    return {
        "model_args": {"model_name_or_path": model, "lora": lora},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "algorithm": {"name": "grpo", "group_size": 4, "rollout_batch_size": 8},
        "actor_train": {
            "strategy_args": {"strategy_name": CONTRACT_FAKE_TRAIN},
            "device_mapping": [0, 1],
            "training_args": {"learning_rate": 1.0e-6},
        },
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}, "device_mapping": [0, 1]},
        "trainer": {"max_steps": 2},
    }


def _errors(raw, host, tmp_path) -> dict[str, str]:
    _, report = build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))
    return {issue.path: issue.render() for issue in report.errors}


def test_impossible_lora_values_are_all_reported(fake_train_host, model_dir, tmp_path):
    lora = {"rank": 0, "alpha": 0, "dropout": 1.0, "rnak": 4}
    errors = _errors(_raw(str(model_dir), lora), fake_train_host, tmp_path)
    assert ">= 1" in errors["model_args.lora.rank"]
    assert "> 0" in errors["model_args.lora.alpha"]
    assert "[0, 1)" in errors["model_args.lora.dropout"]
    assert "did you mean 'rank'" in errors["model_args.lora.rnak"]


def test_empty_target_modules_is_an_error(fake_train_host, model_dir, tmp_path):
    errors = _errors(_raw(str(model_dir), {"target_modules": []}), fake_train_host, tmp_path)
    assert "target_modules is empty" in errors["model_args.lora"]


def test_lora_needs_a_strategy_that_trains_adapters(fake_train_host, model_dir, tmp_path):
    errors = _errors(_raw(str(model_dir), {"rank": 4}), fake_train_host, tmp_path)
    message = errors["actor_train.model_args.lora"]
    assert f"'{CONTRACT_FAKE_TRAIN}' does not train LoRA adapters" in message
    assert "remove model_args.lora" in message


class AdapterSyncFakePlugin:
    """FAKE strategies for core contract tests only (no engine): a trainer of adapters and two
    rollout strategies, one taking adapter-only syncs, one not."""

    @hookimpl
    def posttrain_add_strategies(self):
        def spec(name: str, **capabilities) -> StrategySpec:
            return StrategySpec(
                name=name,
                config_class=EmptyConfig,
                capabilities=Capabilities(**capabilities),
                description="fake strategy for core contract tests",
            )

        return [
            spec("fake_lora_train", kind="train", exports_hf_weights=True, lora=True),
            spec("fake_adapter_rollout", kind="rollout", lora_adapter_sync=True),
            spec("fake_merged_rollout", kind="rollout"),
        ]


@attrs.frozen(kw_only=True)
class EmptyConfig:
    pass


def _sync_workflow(model_dir, tmp_path, rollout: str, sync: str | None):
    from posttrain.host.plugin_host import create_plugin_host

    raw = _raw(str(model_dir), {"rank": 4} | ({"sync": sync} if sync else {}))
    raw["actor_train"]["strategy_args"]["strategy_name"] = "fake_lora_train"
    raw["actor_infer"]["strategy_args"]["strategy_name"] = rollout
    host = create_plugin_host(extra_plugins=[AdapterSyncFakePlugin()])
    return build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))


def test_auto_sync_sends_adapters_where_the_engine_takes_them(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "")
    wf, report = _sync_workflow(model_dir, tmp_path, "fake_adapter_rollout", None)
    assert not report.errors, report.render()
    assert wf.actor_train.model_args.lora.sync == "adapter"
    # The engine learns the adapters it will receive from its own model_args.
    assert wf.actor_infer.model_args.lora == wf.actor_train.model_args.lora

    wf, report = _sync_workflow(model_dir, tmp_path, "fake_merged_rollout", None)
    assert not report.errors, report.render()
    assert wf.actor_train.model_args.lora.sync == "merged"
    assert wf.actor_infer.model_args.lora is None  # whole weights: nothing to apply


def test_adapter_sync_to_an_engine_without_it_is_an_error(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "")
    _, report = _sync_workflow(model_dir, tmp_path, "fake_merged_rollout", "adapter")
    message = {issue.path: issue.render() for issue in report.errors}[
        "actor_train.model_args.lora.sync"
    ]
    assert "'fake_merged_rollout' does not take adapter-only weight syncs" in message
    assert "set sync: merged" in message and "fake_adapter_rollout" in message
