"""``model_args.lora``: typed and range-checked, every mistake at once with its YAML path, and
refused on a trainer whose strategy does not train adapters (``Capabilities.lora``)."""

from __future__ import annotations

from posttrain.config.report import ErrorReport
from posttrain.loading.workflow import build_workflow

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
