"""The conformance kit on ``ddp_train``: run with the plugin installed (``pip install
./examples/third_party_plugin``), ``pytest examples/third_party_plugin/tests``. Two ranks, so that
DDP's all-reduce, the replicas' exports and per-rank checkpoints are exercised; on a machine with
two GPUs, the same on them (NCCL, and weights moved off and back by release/resume_memory)."""

import pytest
import torch

from posttrain.testing import StrategyContract


class TestDDPTrainContract(StrategyContract):
    strategy = "ddp_train"
    world_size = 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
class TestDDPTrainContractCUDA(StrategyContract):
    strategy = "ddp_train"
    world_size = 2
    device = "cuda"
