"""hf_infer with ``tensor_parallel_size: 2`` on 2 gloo ranks, one replica split in two by
transformers' tensor-parallel plan: the conformance kit (log-probs of a forward pass and of the
samples equal transformers' whole model, before and after a weight import), and the samples of
one whole replica."""

from pathlib import Path

import pytest

from posttrain.testing import StrategyContract
from posttrain.testing.contract import structure_config

pytestmark = pytest.mark.timeout(600)
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


class TestHFInferTensorParallelContract(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"tensor_parallel_size": 2}
    world_size = 2

    def test_samples_and_logprobs_equal_one_whole_replicas(self, start):
        split = start()
        assert [p["tp_rank"] for p in split.parallel] == [0, 1]
        assert split.dp_size == 1
        whole = start("hf_infer", structure_config("hf_infer", {})[1], world_size=1)
        got = self._generate(split, n=4, max_new_tokens=8)
        want = self._generate(whole, n=4, max_new_tokens=8)
        assert got.response_ids == want.response_ids
        for a, b in zip(got.response_logprobs, want.response_logprobs):
            assert max(abs(x - y) for x, y in zip(a, b)) <= self.logprob_tolerance


def test_a_split_replica_is_checked_before_anything_starts():
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.loading.workflow import load_workflow

    config = "actor_infer.strategy_args.strategy_config"
    _, report = load_workflow(
        str(QUICKSTART),
        create_plugin_host(),
        {f"{config}.tensor_parallel_size": 4, f"{config}.param_offload": True},
    )
    errors = {issue.path: issue.message for issue in report.errors}
    assert f"{config}.param_offload" in errors  # a split replica stays on the device
    assert any("actor_infer" in p and "device_mapping" in p for p in errors), errors
