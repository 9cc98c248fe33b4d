"""The conformance kit against deepspeed_train at each ZeRO stage (2 ranks, gloo) and
deepspeed_infer (ZeRO-3), on the real DeepSpeed engine."""

import pytest

from posttrain.testing import StrategyContract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class TestDeepSpeedZero1Contract(StrategyContract):
    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 1}
    world_size = 2


class TestDeepSpeedZero2Contract(StrategyContract):
    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 2}
    world_size = 2


class TestDeepSpeedZero3Contract(StrategyContract):
    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 3}
    world_size = 2


class TestDeepSpeedInferContract(StrategyContract):
    strategy = "deepspeed_infer"
    world_size = 2
