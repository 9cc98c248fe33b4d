"""posttrain validate for megatron roles (no torch, no engine), doctor, and the CPU patches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart_megatron.yaml"


def _validate(tmp_path, model_dir, device_mapping, **strategy_config):
    workflow = yaml.safe_load(QUICKSTART.read_text())
    workflow["model_args"]["model_name_or_path"] = str(model_dir)
    workflow["actor_train"]["device_mapping"] = device_mapping
    workflow["actor_train"]["strategy_args"]["strategy_config"] = strategy_config
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(workflow))
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def model_dir(tmp_path):
    """A config.json only: validation reads the model's shape, never its weights."""
    directory = tmp_path / "model"
    directory.mkdir()
    config = {
        "model_type": "qwen3_moe",
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_hidden_layers": 6,
        "num_experts": 6,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "mapping, config, path, message",
    [
        (
            "list(range(0, 4))",
            {"tensor_model_parallel_size": 4},
            "strategy_config.tensor_model_parallel_size",
            "6 attention heads do not divide over 4",
        ),
        (
            "list(range(0, 4))",
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            "strategy_config.pipeline_model_parallel_size",
            "6 layers do not divide into 2 pipeline stage(s) x 2",
        ),
        (
            "list(range(0, 4))",
            {"expert_model_parallel_size": 4},
            "strategy_config.expert_model_parallel_size",
            "6 experts do not divide over 4",
        ),
        (
            "list(range(0, 2))",
            {"use_mbridge": False},
            "strategy_config.use_mbridge",
            "mixture-of-experts model: its weights load through mbridge or from a Megatron dist",
        ),
        (
            "list(range(0, 2))",
            {"context_parallel_size": 2, "attention_backend": "local"},
            "strategy_config.context_parallel_size",
            "local (unfused) attention has no context parallelism",
        ),
        (
            "list(range(0, 2))",
            {"pack_sequences": True, "context_parallel_size": 2},
            "strategy_config.pack_sequences",
            "not split over context-parallel ranks",
        ),
        (
            "list(range(0, 2))",
            {"pack_sequences": True, "attention_backend": "local"},
            "strategy_config.pack_sequences",
            "packed sequences run on the SDPA attention spec",
        ),
        (
            "list(range(0, 3))",
            {"tensor_model_parallel_size": 2},
            "actor_train.device_mapping",
            "3 device(s) do not divide by the parallel sizes",
        ),
        (
            "list(range(0, 2))",
            {"override_transformer_config": {"apply_rope_fusoin": False}},
            "override_transformer_config.apply_rope_fusoin",
            "did you mean 'apply_rope_fusion'",
        ),
        (
            "list(range(0, 2))",
            {"tensor_model_paralel_size": 2},
            "strategy_config.tensor_model_paralel_size",
            "tensor_model_parallel_size",
        ),
    ],
)
def test_validate_reports_layout_mistakes(tmp_path, model_dir, mapping, config, path, message):
    proc = _validate(tmp_path, model_dir, mapping, **config)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout + proc.stderr
    assert path in out and message in out, out


def test_validate_takes_a_dense_model_without_mbridge_and_notes_sp_at_tp1(tmp_path):
    """The plugin's own converter loads dense HF weights; SP at TP1 is turned off (as ROLL's
    recipes expect), with a note."""
    directory = tmp_path / "dense"
    directory.mkdir()
    config = {"model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2}
    (directory / "config.json").write_text(json.dumps(config))
    proc = _validate(
        tmp_path, directory, "list(range(0, 2))", use_mbridge=False, sequence_parallel=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "off at tensor_model_parallel_size 1" in out, out


def test_validate_reports_every_error_at_once_without_importing_torch(tmp_path, model_dir):
    code = (
        "import sys, yaml;"
        f"wf = yaml.safe_load(open({str(QUICKSTART)!r}));"
        f"wf['model_args']['model_name_or_path'] = {str(model_dir)!r};"
        "wf['actor_train']['device_mapping'] = 'list(range(0, 4))';"
        "wf['actor_train']['strategy_args']['strategy_config'] = {"
        "'tensor_model_parallel_size': 4, 'expert_model_parallel_size': 4,"
        "'override_transformer_config': {'hiden_size': 1}};"
        f"open({str(tmp_path / 'all.yaml')!r}, 'w').write(yaml.safe_dump(wf));"
        "from posttrain.cli import main;"
        f"rc = main(['validate', {str(tmp_path / 'all.yaml')!r}]);"
        "print('TORCH', 'torch' in sys.modules, 'megatron.core' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    for fragment in ("attention heads", "experts do not divide", "hiden_size"):
        assert fragment in out, out
    assert "TORCH False False" in out


def test_doctor_reports_megatron_versions():
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},  # rich would truncate the package names
    )
    out = proc.stdout + proc.stderr
    for package in ("megatron-core", "mbridge", "transformer-engine", "apex"):
        assert package in out, out


def test_cpu_patch_targets_exist_in_installed_megatron_core():
    """The CPU support patches stand in for these internals: fail loudly if one disappears."""
    import importlib

    from posttrain_megatron.cpu_support import PATCHED_INTERNALS

    for module, attribute in PATCHED_INTERNALS:
        assert hasattr(importlib.import_module(module), attribute), f"{module}.{attribute}"


@pytest.mark.parametrize(
    ("offloads", "released"),
    [
        ({}, set()),
        ({"param_offload": True}, {"weights"}),
        ({"param_offload": True, "grad_offload": True}, {"weights", "grads"}),
        ({"optimizer_offload": True}, {"optimizer"}),
    ],
)
def test_release_moves_what_the_config_offloads(offloads, released):
    """A colocated megatron role moves to the host only what param_offload / grad_offload /
    optimizer_offload say (as verl); by default it keeps its memory on the device."""
    from types import SimpleNamespace

    from posttrain_megatron.config import MegatronTrainConfig
    from posttrain_megatron.engine import _tags

    worker = SimpleNamespace(config=MegatronTrainConfig(**offloads))
    assert _tags(worker, None) == released
    assert _tags(worker, ["weights"]) == released & {"weights"}


FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


@pytest.mark.parametrize(
    ("strategy", "disable", "config", "expected"),
    [
        # model_args asks for checkpointing and the strategy config sets nothing: full recompute
        ("megatron_train", False, {}, FULL_RECOMPUTE),
        ("megatron_train", True, {}, {}),
        # an inference role keeps no activations for a backward pass
        ("megatron_infer", False, {}, {}),
        # the strategy config's own settings win
        (
            "megatron_train",
            False,
            {"recompute_granularity": "full", "recompute_method": "block"},
            {**FULL_RECOMPUTE, "recompute_method": "block"},
        ),
        (
            "megatron_train",
            False,
            {"recompute_granularity": "selective"},
            {"recompute_granularity": "selective"},
        ),
        (
            "megatron_train",
            False,
            {"moe_layer_recompute": True},
            {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
        ),
        (
            "megatron_train",
            False,
            {"override_transformer_config": {"recompute_granularity": "selective"}},
            {"recompute_granularity": "selective"},
        ),
    ],
)
def test_recompute_follows_model_args_unless_the_strategy_config_sets_it(
    strategy, disable, config, expected
):
    """``model_args.disable_gradient_checkpointing: false`` turns on megatron's activation
    recompute (as it turns on the other trainers' checkpointing); the fields build a valid
    TransformerConfig."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from posttrain.config.sections import ModelArgs
    from posttrain_megatron.config import MegatronInferConfig, MegatronTrainConfig
    from posttrain_megatron.model_builder import transformer_overrides

    config_class = MegatronTrainConfig if strategy == "megatron_train" else MegatronInferConfig
    worker = SimpleNamespace(
        config=config_class(**config),
        strategy_name=strategy,
        model_args=ModelArgs(model_name_or_path="unused", disable_gradient_checkpointing=disable),
        device="cpu",
    )
    overrides = transformer_overrides(worker, SimpleNamespace())
    fields = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    got = {k: v for k, v in overrides.items() if k in (*fields, "recompute_modules")}
    assert got == expected
    transformer = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, **{k: got[k] for k in got}
    )
    for key in fields:
        assert getattr(transformer, key) == expected.get(key)
