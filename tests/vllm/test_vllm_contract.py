"""The conformance kit against the real vLLM engine (in-process engine, CPU)."""

from posttrain.testing import StrategyContract


class TestVLLMContract(StrategyContract):
    strategy = "vllm"
    # Defaults already suit CPU (64 MiB KV cache, eager, in-process engine); spelt out here.
    strategy_config = {"kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}
    logprob_tolerance = 1e-5
