"""The memory plan's estimate of deepspeed_train against what a rank really holds after one
step on 2 gloo ranks (tiny preset, fp32), at ZeRO-2 and ZeRO-3: each part of
``RoleMemory.resident``, and what the train phase adds for gradients (ZeRO-2 frees them in the
optimizer's step). A small reduce bucket keeps DeepSpeed's bucket (``reduce_bucket_size``
elements, whatever the model) the size of the other parts, so both count."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANKS = 2
BUCKET = 65_536  # elements


def estimate(config):
    from ds_workers import BATCH_ROWS, MODEL

    from posttrain import MemoryQuery, Workload
    from posttrain.config.sections import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
    from posttrain.memory.geometry import read_geometry
    from posttrain_deepspeed.plugin import plugin

    role = RoleConfig(
        strategy_args=StrategyArgs(strategy_name="deepspeed_train", strategy_config=config),
        device_mapping=tuple(range(RANKS)),
        model_args=ModelArgs(model_name_or_path=MODEL, disable_gradient_checkpointing=False),
        training_args=TrainingArgs(),
    )
    query = MemoryQuery(
        role_name="actor_train",
        role=role,
        config=config,
        geometry=read_geometry(MODEL),
        workload=Workload(rows=BATCH_ROWS, prompt_tokens=6, response_tokens=11, bucket_bytes=0),
        device="cpu",
    )
    return plugin.posttrain_estimate_memory(query=query)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """``{stage: [parts of rank 0, parts of rank 1]}``: both stages in one pair of ranks."""
    from ds_workers import launch

    out = tmp_path_factory.mktemp("ds-memory")
    launch("memory", RANKS, str(out), stages=(2, 3), reduce_bucket_size=BUCKET)
    return {stage: torch.load(out / f"memory_z{stage}.pt", weights_only=False) for stage in (2, 3)}


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_estimate_matches_what_a_rank_holds_after_a_step(measured, stage):
    from ds_workers import _config

    measured = measured[stage]
    planned = estimate(_config(stage, reduce_bucket_size=BUCKET))
    resident, train = planned.resident, planned.phases["train"]
    print(f"resident {dict(resident)}, train grads {train['grads']}")
    for rank, held in enumerate(measured):
        print(f"rank {rank}: measured {held}")
    # The busiest rank is what the plan is for.
    worst = {part: max(held[part] for held in measured) for part in measured[0]}
    # float32 weights (ZeRO-3: partitions plus its persistent small tensors, here all of them);
    # the float32 master partition and AdamW's moments (12 bytes a parameter, fp32 or not).
    assert worst["weights"] == pytest.approx(resident["weights"], rel=0.01)
    assert worst["optimizer"] == pytest.approx(resident["optimizer"], rel=0.01)
    if stage == 3:
        # The gradient partitions and the reduce bucket stay between steps.
        assert worst["grads"] == pytest.approx(resident["grads"], rel=0.01)
        assert train["grads"] == 0
    else:
        # Freed in the step (a scalar norm is left); while training: the partition's
        # gradients (whole tensors where a boundary cuts one) and the bucket.
        assert worst["grads"] < 64
        assert resident["grads"] == 0
        assert worst["grads_at_step"] + worst["buckets"] == pytest.approx(train["grads"], rel=0.15)
