"""The memory plan's estimate of fsdp2_train against what a rank really holds after one step
on 2 gloo ranks (tiny preset), computing in fp32 and in bf16 (mixed precision: float32 master
weights either way): each part of ``RoleMemory.resident``, and the gradients (which live only
inside a train call) at the optimizer's step."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RANKS = 2
PARAM_DTYPES = (None, "bf16")


def estimate(config):
    from fsdp_workers import BATCH_ROWS, MODEL

    from posttrain.testing.memory import role_estimate
    from posttrain_fsdp.plugin import plugin

    return role_estimate(
        plugin,
        "fsdp2_train",
        config,
        model=MODEL,
        ranks=RANKS,
        rows=BATCH_ROWS,
        prompt_tokens=6,
        response_tokens=11,
        model_args={"disable_gradient_checkpointing": False},
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """``{param_dtype: [parts of rank 0, parts of rank 1]}``, both in one pair of ranks."""
    from fsdp_workers import launch

    out = tmp_path_factory.mktemp("fsdp-memory")
    launch("memory", RANKS, str(out), param_dtypes=PARAM_DTYPES)
    return {d: torch.load(out / f"memory_{d}.pt", weights_only=False) for d in PARAM_DTYPES}


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=["fp32", "bf16"])
def test_estimate_matches_what_a_rank_holds_after_a_step(measured, param_dtype):
    from posttrain_fsdp.plugin import FSDP2TrainConfig

    planned = estimate(FSDP2TrainConfig(micro_batch_size=3, param_dtype=param_dtype))
    for rank, held in enumerate(measured[param_dtype]):
        print(f"rank {rank}: measured {held}; resident {dict(planned.resident)}")
        # Float32 master weights and AdamW's two moments, each rank's shard (FSDP pads a
        # parameter's first dimension to the ranks; Adam's step counters are a few bytes).
        assert held["weights"] == pytest.approx(planned.resident["weights"], rel=0.01)
        assert held["optimizer"] == pytest.approx(planned.resident["optimizer"], rel=0.01)
        # Gradients exist only within a train call (set to None after the step): not resident,
        # a part of the train phase; float32 shards (reduced in bf16, kept in the master dtype).
        assert held["grads"] == 0
        assert "grads" not in planned.resident
        assert held["grads_at_step"] == pytest.approx(planned.phases["train"]["grads"], rel=0.01)


def test_a_moe_models_plan_counts_every_expert():
    """A mixture-of-experts model's weights are its experts' too (the plan read it as dense)."""
    import transformers

    from posttrain.tasks.presets import preset_path
    from posttrain.testing.memory import role_estimate
    from posttrain_fsdp.plugin import FSDP2TrainConfig, plugin

    name = "preset:tiny-qwen3-moe"
    config = transformers.AutoConfig.from_pretrained(preset_path(name))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    planned = role_estimate(
        plugin, "fsdp2_train", FSDP2TrainConfig(), model=name, ranks=RANKS, rows=4,
        prompt_tokens=6, response_tokens=11,
    )  # fmt: skip
    # Float32 master weights, each rank's shard.
    assert planned.resident["weights"] == pytest.approx(4 * params / RANKS, rel=0.01)
