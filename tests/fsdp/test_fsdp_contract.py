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

    # CI time: the LoRA-specific tests only (the LoRA resume is tests/e2e/test_lora.py's, bitwise
    # through a SIGKILL); the rest is TestFSDP2TrainContract's, unchanged by adapters.
    test_declared_capabilities_match_implemented_hooks = None
    test_setup_reports_data_parallel_coordinates = None
    test_logprobs_match_transformers_forward = None
    test_checkpoint_round_trip_is_exact = None
    test_critic_values_match_transformers_forward = None
    test_critic_checkpoint_round_trip_is_exact = None
    test_critic_value_step_reduces_value_loss = None
