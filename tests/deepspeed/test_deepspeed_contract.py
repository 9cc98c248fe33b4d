"""The conformance kit against deepspeed_train at each ZeRO stage (2 ranks, gloo) and
deepspeed_infer (ZeRO-3), on the real DeepSpeed engine."""

import pytest

from posttrain.testing import StrategyContract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class TestDeepSpeedZero1Contract(StrategyContract):
    """ZeRO-1 differs from ZeRO-2 in what DeepSpeed partitions (the optimizer state alone), not
    in the plugin's code: it runs the kit's tests that hold optimizer state (a step, then a sync
    or a checkpoint round trip); loading, scoring and export are ZeRO-2's (CI time)."""

    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 1}
    world_size = 2
    test_setup_reports_data_parallel_coordinates = None
    test_logprobs_match_transformers_forward = None
    test_export_weights_equal_loaded_checkpoint = None
    test_train_then_in_process_sync_logprob_parity = None


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


class TestDeepSpeedBesideDeepSpeed:
    """Hybrid engine with two DeepSpeed engines in each rank process: deepspeed_train (ZeRO-2)
    and a deepspeed_infer reference (ZeRO-3), started by the kit's fixture."""

    strategy = "deepspeed_train"
    strategy_config = {"zero_stage": 2}
    world_size = 2
    group_timeout_s = StrategyContract.group_timeout_s
    device = "cpu"
    lora = StrategyContract.lora
    spec_and_config = StrategyContract.spec_and_config
    start = StrategyContract.start
    group_spec = classmethod(StrategyContract.group_spec.__func__)

    def test_train_beside_a_deepspeed_infer_reference(self, start, tiny_model_path):
        from posttrain.protocol import concat_tensor_rows
        from posttrain.testing.expected import reference_logprobs, synthetic_train_batch

        trainer, reference = start(beside=("deepspeed_infer", "reference"))
        assert trainer.shares_processes_with(reference)
        batch = synthetic_train_batch(dp_size=trainer.dp_size)
        before = concat_tensor_rows(trainer.call_dp("compute_logprobs", batch.split(2)))
        trainer.call_dp("train_step", batch.split(trainer.dp_size))
        after = concat_tensor_rows(trainer.call_dp("compute_logprobs", batch.split(2)))
        ref = concat_tensor_rows(reference.call_dp("compute_logprobs", batch.split(2)))
        expected = reference_logprobs(tiny_model_path, None, batch)
        mask = batch.attention_mask
        # The reference keeps the initial weights while the trainer beside it moves on.
        assert float(((ref - expected) * mask).abs().max()) <= 1e-5
        assert float(((before - expected) * mask).abs().max()) <= 1e-5
        assert float(((after - before) * mask).abs().max()) > 1e-3
