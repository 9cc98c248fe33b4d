"""The conformance kit for deepspeed_train at ZeRO-3 (and ZeRO-2) on CUDA GPUs with NCCL
(skipped without).

Run on the GPU machine: ``python -m pytest -m gpu tests/deepspeed/test_deepspeed_gpu.py``.
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


class TestDeepSpeedZero3ContractCUDA(StrategyContract):
    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 3}
    world_size = min(GPUS, 2) or 1
    device = "cuda"


class TestDeepSpeedZero2ContractCUDA(StrategyContract):
    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 2}
    world_size = min(GPUS, 2) or 1
    device = "cuda"
