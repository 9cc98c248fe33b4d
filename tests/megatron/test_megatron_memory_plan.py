"""The memory plan's estimate of megatron_train against what a rank really holds after one RL
step: the tiny preset (fp32) on 2 gloo ranks, data-parallel with the distributed optimizer,
each part of ``RoleMemory.resident``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MODEL = "preset:tiny-qwen2"
RANKS = 2
LAYOUT = {"use_distributed_optimizer": True}


def estimate(config):
    from megatron_workers import BATCH_ROWS

    from posttrain import MemoryQuery, Workload
    from posttrain.config.sections import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
    from posttrain.memory.geometry import read_geometry
    from posttrain_megatron.plugin import plugin

    role = RoleConfig(
        strategy_args=StrategyArgs(strategy_name="megatron_train", strategy_config=config),
        device_mapping=tuple(range(RANKS)),
        model_args=ModelArgs(model_name_or_path=MODEL),
        training_args=TrainingArgs(per_device_train_batch_size=2),
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


def test_estimate_matches_what_a_rank_holds_after_a_step(tmp_path, tiny_model_path):
    from megatron_workers import launch

    from posttrain_megatron.config import MegatronTrainConfig

    launch("memory", RANKS, str(tmp_path), model=MODEL, layout=LAYOUT)
    measured = torch.load(tmp_path / "memory.pt", weights_only=False)
    resident = estimate(MegatronTrainConfig(**LAYOUT)).resident
    print(f"resident {dict(resident)}")
    for rank, held in enumerate(measured):
        print(f"rank {rank}: measured {held}")
        # The whole model and its DDP gradient buffer (float32: grad_reduce_in_fp32), padded
        # to the buffer's alignment; AdamW's moments of this rank's shard, and no master copy
        # (the float32 shards are views of the parameters).
        assert held["weights"] == pytest.approx(resident["weights"], rel=0.01)
        assert held["grads"] == pytest.approx(resident["grads"], rel=0.01)
        assert held["optimizer"] == pytest.approx(resident["optimizer"], rel=0.01)
