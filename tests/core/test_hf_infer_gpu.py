"""The conformance kit for hf_infer on a CUDA GPU in each decode mode: log-probs equal a
transformers forward, before and after weights are imported (the kit generates before the import
too: a CUDA graph captured then replays the new weights, copied in place). Skipped without a GPU.

Run on the GPU machine: ``python -m pytest -m gpu tests/core/test_hf_infer_gpu.py``.
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
