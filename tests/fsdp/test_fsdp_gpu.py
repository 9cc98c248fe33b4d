"""The conformance kit for fsdp2_train / fsdp2_infer on CUDA GPUs with NCCL (skipped without).

Run on the GPU machine: ``python -m pytest -m gpu tests/fsdp``.
"""

import pytest
import torch

from posttrain.testing import StrategyContract

GPUS = torch.cuda.device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]


class TestFSDP2TrainContractCUDA(StrategyContract):
    strategy = "fsdp2_train"
    world_size = min(GPUS, 2) or 1
    device = "cuda"


class TestFSDP2InferContractCUDA(StrategyContract):
    strategy = "fsdp2_infer"
    world_size = min(GPUS, 2) or 1
    device = "cuda"
