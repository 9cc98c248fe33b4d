"""The conformance kit for hf_infer on a CUDA GPU in each decode mode: log-probs equal a
transformers forward, before and after weights are imported (the kit generates before the import
too: a CUDA graph captured then replays the new weights, copied in place). Skipped without a GPU.

Run on the GPU machine: ``python -m pytest -m gpu tests/hf_infer/test_hf_infer_gpu.py``.
"""

import pytest
import torch

from posttrain.testing import StrategyContract

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]


class TestHFInferDynamicContractCUDA(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"decode": "dynamic"}
    device = "cuda"


class TestHFInferCudaGraphContractCUDA(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"decode": "cuda_graph"}
    device = "cuda"
    supports_checkpoint = False  # no decoding in it: the dynamic class runs it


class TestHFInferCompiledContractCUDA(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"decode": "compiled"}
    device = "cuda"
    supports_checkpoint = False  # no decoding in it: the dynamic class runs it


class TestHFInferReleasedCUDA(StrategyContract):
    """``param_offload: true``: the weights wait in page-locked host memory while a colocated
    role runs, and come back unchanged."""

    strategy = "hf_infer"
    strategy_config = {"decode": "cuda_graph", "param_offload": True}
    device = "cuda"
    supports_checkpoint = False

    def test_released_weights_come_back_the_same(self, start):
        group = start()
        before = self._generate(group)
        for _ in range(2):  # the second release reuses the host buffers of the first
            group.call("release_memory", ["weights", "kv_cache"])
            group.call("resume_memory", ["weights", "kv_cache"])
        after = self._generate(group)
        assert after.response_ids == before.response_ids
        assert after.response_logprobs == before.response_logprobs
