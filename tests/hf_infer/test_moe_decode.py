"""hf_infer's fixed-shape decode of a mixture-of-experts model (moe_decode): the static step (the
graphed one's code on the CPU) and the compiled one sample what the dynamic decode samples, and
return each sample's routing as the dynamic decode does, continuous batching's refilled rows
included."""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("posttrain_hf_infer")

from posttrain import GenerationRequest, SamplingParams  # noqa: E402
from posttrain.backend import record_routing  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [7], [9, 9, 9, 9], [15, 16, 17]]


@pytest.fixture(scope="module")
def moe_worker(hf_infer_loader):
    return hf_infer_loader("preset:tiny-qwen3-moe", batch_size=3)


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of 4 slots: the steps attend to growing windows, not the whole cache."""
    from posttrain_hf_infer import static_decode

    monkeypatch.setattr(static_decode, "WINDOW_BUCKET", 4)


def generate(worker, decode: str, sampling: SamplingParams, seed: int, prompts=PROMPTS):
    from posttrain_hf_infer import engine
    from posttrain_hf_infer.engine import HFInferState

    worker.config = attrs.evolve(worker.config, decode=decode)
    worker.engine_state(HFInferState).decoders = None
    request = GenerationRequest(
        prompt_ids=prompts, sampling=sampling, seed=seed, return_routing=True
    )
    return engine.generate(worker, request)


def assert_same_samples(a, b) -> None:
    assert a.response_ids == b.response_ids
    for x, y in zip(a.response_logprobs, b.response_logprobs):
        assert x == pytest.approx(y, abs=1e-5)
    assert len(a.routing) == len(b.routing)
    for x, y in zip(a.routing, b.routing):
        assert x.dtype == y.dtype == torch.uint8
        assert torch.equal(x, y)


def assert_routed_as_a_forward_pass(model, samples) -> None:
    """Each sample's routing is a forward pass's over its tokens (the last: zeros)."""
    for prompt, response, routing in zip(samples.prompt_ids, samples.response_ids, samples.routing):
        tokens = prompt + response
        assert routing.shape == (len(tokens), 2, 2)  # 2 MoE layers, top-2
        with torch.no_grad(), record_routing(model) as record:
            model(input_ids=torch.tensor([tokens]))
        assert torch.equal(routing[:-1], record.take()[:-1])
        assert not routing[-1].any()


def test_the_static_step_samples_and_routes_as_the_dynamic_decode(moe_worker, small_windows):
    sampling = SamplingParams(n=2, max_new_tokens=7, ignore_eos=True)
    dynamic = generate(moe_worker, "dynamic", sampling, seed=4)
    static = generate(moe_worker, "static", sampling, seed=4)
    assert_same_samples(dynamic, static)
    assert_routed_as_a_forward_pass(moe_worker.model, static)


def test_refilled_rows_return_their_routing(moe_worker, small_windows, monkeypatch):
    """Three rows for six prompts, the host looking every 3 steps, samples ending at a stop
    token after different numbers of steps: ended rows stand still until a look (they write no
    routing meanwhile) and are refilled with the next prompts while the others decode."""
    from posttrain_hf_infer import decode_loop

    monkeypatch.setattr(decode_loop, "look_interval", lambda device, sampling: 3)
    refills = []
    refill = decode_loop.StaticDecode.refill

    def counted(self, rows, prompts):
        refills.append(rows)
        return refill(self, rows, prompts)

    monkeypatch.setattr(decode_loop.StaticDecode, "refill", counted)
    stops = tuple(range(3, 40, 3))
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=stops)
    static = generate(moe_worker, "static", sampling, seed=2)
    assert refills
    assert len({len(r) for r in static.response_ids}) > 1
    assert_routed_as_a_forward_pass(moe_worker.model, static)


def test_the_compiled_step_samples_and_routes_as_the_static_step(
    moe_worker, small_windows, monkeypatch
):
    """The compiled step (Dynamo with an eager backend: its tracing and guards, not Inductor's
    minutes) writes the routing inside the traced step; decoders of another rows bucket run the
    same compiled code (the routing slots are inputs, not constants)."""
    from posttrain_hf_infer import static_decode

    compiles = []

    def eager(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    monkeypatch.setattr(static_decode, "STEP_BACKEND", eager)
    monkeypatch.setattr(static_decode, "_compiled_forward", None)
    sampling = SamplingParams(n=2, max_new_tokens=9, temperature=0.0)
    static = generate(moe_worker, "static", sampling, seed=1)
    compiled = generate(moe_worker, "compiled", sampling, seed=1)
    assert compiles
    assert_same_samples(static, compiled)
    assert_routed_as_a_forward_pass(moe_worker.model, compiled)
    traced = len(compiles)
    more = generate(moe_worker, "compiled", attrs.evolve(sampling, n=3), seed=1)  # 9 rows of 16
    assert len(compiles) == traced
    assert_routed_as_a_forward_pass(moe_worker.model, more)
