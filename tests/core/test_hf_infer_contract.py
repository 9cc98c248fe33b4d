"""The conformance kit against the reference strategy, hf_infer."""

from posttrain.testing import StrategyContract


class TestHFInferContract(StrategyContract):
    strategy = "hf_infer"
    supports_checkpoint = True
