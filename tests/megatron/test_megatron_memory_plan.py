"""The memory plan's estimate of megatron_train against what a rank really holds after one RL
step: the tiny preset on 2 gloo ranks, data-parallel with the distributed optimizer, in fp32
(megatron's FP32Optimizer: no master copy) and bf16 (its float16 optimizer: float32 master
shards), each part of ``RoleMemory.resident``. Both runs share one pair of ranks."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MODEL = "preset:tiny-qwen2"
RANKS = 2
LAYOUT = {"use_distributed_optimizer": True}
DTYPES = ("fp32", "bf16")


def estimate(config, dtype):
    from megatron_workers import BATCH_ROWS

    from posttrain.testing.memory import role_estimate
    from posttrain_megatron.plugin import plugin

    return role_estimate(
        plugin,
        "megatron_train",
        config,
        model=MODEL,
        ranks=RANKS,
        rows=BATCH_ROWS,
        prompt_tokens=6,
        response_tokens=11,
        model_args={"dtype": dtype},
        training_args={"per_device_train_batch_size": 2},
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory, tiny_model_path):
    """``{dtype: [parts of rank 0, parts of rank 1]}``."""
    from megatron_workers import launch

    out = tmp_path_factory.mktemp("megatron-memory")
    launch("memory", RANKS, str(out), model=MODEL, layout=LAYOUT, dtypes=DTYPES)
    return {dtype: torch.load(out / f"memory_{dtype}.pt", weights_only=False) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimate_matches_what_a_rank_holds_after_a_step(measured, dtype):
    from posttrain_megatron.config import MegatronTrainConfig

    resident = estimate(MegatronTrainConfig(**LAYOUT), dtype).resident
    print(f"resident {dict(resident)}")
    for rank, held in enumerate(measured[dtype]):
        print(f"rank {rank}: measured {held}")
        # The whole model and its DDP gradient buffer in the compute dtype (fp32 reduces in
        # fp32, bf16 in bf16), padded to the buffer's alignment; AdamW's moments of this rank's
        # shard, with a float32 master shard only below fp32 (fp32's shards are views of the
        # parameters).
        assert held["weights"] == pytest.approx(resident["weights"], rel=0.01)
        assert held["grads"] == pytest.approx(resident["grads"], rel=0.01)
        assert held["optimizer"] == pytest.approx(resident["optimizer"], rel=0.01)
