"""The conformance kit against fsdp2_train (2 ranks) and fsdp2_infer, on the real FSDP2 engine."""

import pytest

from posttrain.config.sections import LoraArgs
from posttrain.testing import StrategyContract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class TestFSDP2TrainContract(StrategyContract):
    strategy = "fsdp2_train"
    world_size = 2


class TestFSDP2InferContract(StrategyContract):
    strategy = "fsdp2_infer"
    world_size = 2


class TestFSDP2TrainLoraContract(StrategyContract):
    """The trainer contract with LoRA adapters: the export and every sync send merged weights
    under the base names (at step 0 they equal the checkpoint's exactly), the synced rollout's
    log-probs equal the trainer's, checkpoints of adapters and optimizer round-trip exactly."""

    strategy = "fsdp2_train"
    world_size = 2
    lora = LoraArgs(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])
