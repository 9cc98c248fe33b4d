"""strategy_config of ``vllm``: typed, unknown keys are errors; engine_kwargs checked by vLLM."""

from __future__ import annotations

import pytest

from posttrain.config.converter import CONVERTER
from posttrain.errors import UserError
from posttrain.host.plugin_host import create_plugin_host


def _config_class():
    return create_plugin_host().strategies()["vllm"].config_class


def test_defaults_and_parallel_dims():
    spec = create_plugin_host().strategies()["vllm"]
    cfg = CONVERTER.structure({}, spec.config_class)
    assert cfg.tensor_parallel_size == 1
    assert cfg.enforce_eager is True
    assert spec.capabilities.parallel_dims == ("tensor_parallel_size",)
    assert spec.capabilities.kind == "rollout"


@pytest.mark.parametrize(
    "raw",
    [
        {"tensor_paralel_size": 2},
        {"tensor_parallel_size": 0},
        {"sleep_level": 3},
        {"gpu_memory_utilization": 1.5},
    ],
)
def test_bad_strategy_config_is_an_error(raw):
    with pytest.raises(Exception) as info:
        CONVERTER.structure(raw, _config_class())
    if "tensor_paralel_size" in raw:  # an unknown key is named in the error
        assert "tensor_paralel_size" in repr(info.value) + str(
            getattr(info.value, "exceptions", "")
        )


def test_unknown_engine_kwargs_name_the_key():
    from posttrain_vllm.engine import check_engine_kwargs

    check_engine_kwargs({"max_num_seqs": 8, "block_size": 32})
    with pytest.raises(UserError, match=r"max_num_seq'.*did you mean 'max_num_seqs'"):
        check_engine_kwargs({"max_num_seq": 8})


def test_engine_args_for_cpu(tiny_model_path):
    from posttrain.config.sections import ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_vllm.engine import CPU_KV_CACHE_BYTES, engine_args

    cfg = CONVERTER.structure({"seed": 3, "max_model_len": 64}, _config_class())
    worker = WorkerContext(
        role="actor_infer",
        strategy_name="vllm",
        config=cfg,
        model_args=ModelArgs(model_name_or_path=tiny_model_path),
    )
    args = engine_args(worker)
    assert args["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert args["logprobs_mode"] == "raw_logprobs"
    assert args["dtype"] == "float32" and args["seed"] == 3 and args["max_model_len"] == 64
    assert "enable_sleep_mode" not in args  # no sleep mode on CPU


def test_cpu_head_size_16_is_refused_clearly(posttrain_cache):
    from posttrain.tasks.presets import preset_path
    from posttrain_vllm.engine import check_cpu_head_size

    with pytest.raises(UserError, match="head size is 16"):
        check_cpu_head_size(preset_path("preset:tiny-qwen2"))


def test_doctor_check_reads_vllm_version():
    from posttrain.host.doctor import run_check

    checks = create_plugin_host().hook.posttrain_environment_checks()
    mine = [c for group in checks for c in group if c.package == "vllm"]
    assert len(mine) == 1
    assert run_check(mine[0]).status == "ok"
