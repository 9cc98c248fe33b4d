"""The conformance kit against fsdp2_train (2 ranks) and fsdp2_infer, on the real FSDP2 engine."""

import pytest

from posttrain.testing import StrategyContract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class TestFSDP2TrainContract(StrategyContract):
    strategy = "fsdp2_train"
    world_size = 2


class TestFSDP2InferContract(StrategyContract):
    strategy = "fsdp2_infer"
    world_size = 2
