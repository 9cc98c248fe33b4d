"""strategy_config of ``sglang``: typed, unknown keys are errors; engine_kwargs checked against
SGLang's ServerArgs; the engine arguments for CPU; doctor; the CPU import shims. No engine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from posttrain.config.converter import CONVERTER
from posttrain.errors import UserError
from posttrain.host.plugin_host import create_plugin_host


def _spec():
    return create_plugin_host().strategies()["sglang"]


def test_defaults_and_capabilities():
    spec = _spec()
    cfg = CONVERTER.structure({}, spec.config_class)
    assert cfg.tp_size == 1 and cfg.engine_kwargs == {}
    assert spec.capabilities.parallel_dims == ("tp_size",)
    assert spec.capabilities.kind == "rollout"
    assert set(spec.capabilities.import_transports) == {"in_process", "shared_memory", "broadcast"}
    assert spec.capabilities.shares_process
    assert spec.capabilities.stop_strings  # validation lets stop strings through


@pytest.mark.parametrize(
    "raw",
    [
        {"tp_sise": 2},
        {"tp_size": 0},
        {"mem_fraction_static": 1.5},
        {"max_total_tokens": 0},
        {"device": "tpu"},
        {"dtype": "int8"},
    ],
)
def test_bad_strategy_config_is_an_error(raw):
    with pytest.raises(Exception) as info:
        CONVERTER.structure(raw, _spec().config_class)
    if "tp_sise" in raw:  # an unknown key is named in the error
        assert "tp_sise" in repr(info.value) + str(getattr(info.value, "exceptions", ""))


def test_validate_names_the_unknown_key(tmp_path):
    """Through the CLI: `posttrain validate` reports the bad key with its YAML path."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "examples" / "quickstart_sglang.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("max_total_tokens: 4096", "max_total_tokns: 4096"))
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "validate", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "max_total_tokns" in proc.stdout + proc.stderr


def test_engine_kwargs_are_checked_against_server_args():
    from posttrain_sglang.args import check_engine_kwargs

    check_engine_kwargs({"max_running_requests": 8, "chunked_prefill_size": 512})
    hint = r"'max_running_request' \(did you mean 'max_running_requests'\?\)"
    with pytest.raises(UserError, match=hint):
        check_engine_kwargs({"max_running_request": 8})
    # Fields strategy_config owns go there, not through the passthrough.
    with pytest.raises(UserError, match=r"set 'tp_size' in strategy_config"):
        check_engine_kwargs({"tp_size": 2})


def test_engine_args_for_cpu(tiny_model_path):
    from posttrain.config.sections import GeneratingArgs, ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_sglang.args import CPU_MAX_TOTAL_TOKENS, engine_args

    cfg = CONVERTER.structure({"random_seed": 3, "context_length": 64}, _spec().config_class)
    worker = WorkerContext(
        role="actor_infer",
        strategy_name="sglang",
        config=cfg,
        model_args=ModelArgs(model_name_or_path=tiny_model_path),
        generating_args=GeneratingArgs(),
    )
    args = engine_args(worker)
    assert args["max_total_tokens"] == CPU_MAX_TOTAL_TOKENS
    assert args["attention_backend"] == "torch_native"
    assert args["device"] == "cpu" and args["dtype"] == "float32"
    assert args["random_seed"] == 3 and args["context_length"] == 64
    assert args["skip_tokenizer_init"] is True  # no stop strings: no tokenizer in the engine
    assert "enable_memory_saver" not in args  # SGLang releases no memory on CPU
    from posttrain_sglang.args import server_args_fields

    assert set(args) <= server_args_fields()


def test_doctor_check_reads_sglang_version():
    from posttrain.host.doctor import run_check

    checks = create_plugin_host().hook.posttrain_environment_checks()
    mine = [c for group in checks for c in group if c.package == "sglang"]
    assert len(mine) == 1
    result = run_check(mine[0])
    assert result.status == "ok", result


def test_shims_serve_sglang_only_and_compute_nothing():
    """The test-support shims stand in for torchvision / sgl_kernel imports made by SGLang; other
    callers (transformers' availability probes) still see the packages as missing, and every
    placeholder refuses to run."""
    from posttrain_sglang import testing_shims

    assert testing_shims.installed(), ".pth of .ci/sglang_env.sh is not installed"
    assert importlib.util.find_spec("torchvision") is None
    assert importlib.util.find_spec("sgl_kernel") is None
    from transformers.utils import is_torchvision_available

    assert not is_torchvision_available()
    import sglang.srt.entrypoints.engine  # noqa: F401  (imports both through the shims)

    kernel = sys.modules["sgl_kernel"]
    assert testing_shims.is_shim(kernel)
    with pytest.raises(NotImplementedError, match="not installed"):
        kernel.copy_all_layer_kv_cache_cpu()
    with pytest.raises(AttributeError):
        kernel.some_kernel_nobody_listed  # noqa: B018
    import torch

    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # AMX path stays off
