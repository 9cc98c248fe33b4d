"""The memory plan's estimate of deepspeed_train against what a rank really holds after one
step on 2 gloo ranks (tiny preset), at ZeRO-2 and ZeRO-3, in fp32 and in bf16 (DeepSpeed's mixed
precision, which runs on the CPU too): each part of ``RoleMemory.resident``, and what the train
phase adds for gradients (ZeRO-2 frees them in the optimizer's step). A small reduce bucket
keeps DeepSpeed's bucket (``reduce_bucket_size`` elements, whatever the model) the size of the
other parts, so both count. All four runs share one pair of ranks."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANKS = 2
BUCKET = 65_536  # elements


RUNS = [(2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")]


def estimate(config, dtype):
    from ds_workers import BATCH_ROWS, MODEL

    from posttrain.testing.memory import role_estimate
    from posttrain_deepspeed.plugin import plugin

    return role_estimate(
        plugin,
        "deepspeed_train",
        config,
        model=MODEL,
        ranks=RANKS,
        rows=BATCH_ROWS,
        prompt_tokens=6,
        response_tokens=11,
        model_args={"disable_gradient_checkpointing": False, "dtype": dtype},
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """``{(stage, dtype): [parts of rank 0, parts of rank 1]}``: every run in one pair of ranks
    (the imports and process start are most of a run's time)."""
    from ds_workers import launch

    out = tmp_path_factory.mktemp("ds-memory")
    launch("memory", RANKS, str(out), runs=RUNS, reduce_bucket_size=BUCKET)
    return {
        (stage, dtype): torch.load(out / f"memory_z{stage}_{dtype}.pt", weights_only=False)
        for stage, dtype in RUNS
    }


@pytest.mark.parametrize(("stage", "dtype"), RUNS, ids=[f"zero{s}-{d}" for s, d in RUNS])
def test_estimate_matches_what_a_rank_holds_after_a_step(measured, stage, dtype):
    from ds_workers import _config

    measured = measured[stage, dtype]
    planned = estimate(_config(stage, reduce_bucket_size=BUCKET), dtype)
    resident, train = planned.resident, planned.phases["train"]
    print(f"resident {dict(resident)}, train grads {train['grads']}")
    for rank, held in enumerate(measured):
        print(f"rank {rank}: measured {held}")
    # The busiest rank is what the plan is for.
    worst = {part: max(held[part] for held in measured) for part in measured[0]}
    # Weights in the compute dtype (ZeRO-3: partitions plus its persistent small tensors, here
    # all of them); the float32 master partition and AdamW's moments (12 bytes a parameter,
    # fp32 or not).
    assert worst["weights"] == pytest.approx(resident["weights"], rel=0.01)
    assert worst["optimizer"] == pytest.approx(resident["optimizer"], rel=0.01)
    if stage == 3:
        # The gradient partitions and the reduce bucket (compute dtype) stay between steps.
        assert worst["grads"] == pytest.approx(resident["grads"], rel=0.01)
        assert train["grads"] == 0
    else:
        # Freed in the step (a scalar norm is left); while training: the partition's
        # gradients (compute dtype; whole tensors where a boundary cuts one) and the bucket.
        assert worst["grads"] < 64
        assert resident["grads"] == 0
        assert worst["grads_at_step"] + worst["buckets"] == pytest.approx(train["grads"], rel=0.15)
