"""hf_infer's fixed-shape decode (``strategy_config.decode: static``; ``cuda_graph`` runs the same
step captured in a CUDA graph): the same samples and log-probs as the dynamic cache, a decoder
reused across generations and shape buckets, and the conformance kit in that mode."""

from __future__ import annotations

import attrs
import pytest

from posttrain.protocol import GenerationRequest, SamplingParams
from posttrain.testing import StrategyContract
from posttrain.testing.batches import PROMPTS


class TestHFInferStaticDecodeContract(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"decode": "static"}
    supports_checkpoint = False  # no decoding in it: test_hf_infer_contract.py runs it


def generate(worker, decode: str, prompts, sampling, seed: int):
    from posttrain.backends import hf_infer

    worker.config = attrs.evolve(worker.config, decode=decode)
    return hf_infer.generate(
        worker, GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=seed)
    )


def test_static_decode_samples_what_the_dynamic_cache_samples(hf_infer_worker):
    from posttrain.backends import hf_infer

    worker = hf_infer_worker
    original = worker.config
    try:
        # 3 prompts x 3 samples: 9 rows in a decoder of 16; prompts of different lengths.
        sampling = SamplingParams(n=3, max_new_tokens=7)
        dynamic = generate(worker, "dynamic", PROMPTS[:3], sampling, seed=4)
        static = generate(worker, "static", PROMPTS[:3], sampling, seed=4)
        # Again on the kept decoder (its cache emptied), then in a second shape bucket.
        again = generate(worker, "static", PROMPTS[:3], sampling, seed=4)
        fewer = attrs.evolve(sampling, n=2)
        other = generate(worker, "static", PROMPTS[1:3], fewer, seed=9)
        other_dynamic = generate(worker, "dynamic", PROMPTS[1:3], fewer, seed=9)
        assert sorted(worker.state["decoders"]._decoders) == [(8, 128), (16, 128)]
    finally:
        worker.config = original
        worker.state.pop("decoders", None)
    for a, b in ((dynamic, static), (static, again), (other_dynamic, other)):
        assert a.response_ids == b.response_ids
        for x, y in zip(a.response_logprobs, b.response_logprobs):
            assert x == pytest.approx(y, abs=1e-5)
    assert hf_infer.decode_mode(worker) == "dynamic"  # auto, on the CPU
