"""hf_infer returns each sample's routing (mixture-of-experts models, for routing replay): the
experts every layer chose for each prompt and response token, as a forward pass over the whole
sample routes them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("posttrain_hf_infer")

from posttrain import GenerationRequest, SamplingParams  # noqa: E402
from posttrain.backend import record_routing  # noqa: E402

# Prompts of three lengths (left padding differs by row); with batch_size 2 and n=2, two
# batches of rows are started one after the other.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(scope="module", params=["dynamic", "static"])
def moe_worker(request, hf_infer_loader):
    return hf_infer_loader("preset:tiny-qwen3-moe", batch_size=2, decode=request.param)


def test_each_sample_carries_the_routing_of_its_tokens(moe_worker):
    from posttrain_hf_infer import engine

    sampling = SamplingParams(n=2, max_new_tokens=4, ignore_eos=True)
    request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=3, return_routing=True)
    samples = engine.generate(moe_worker, request)
    assert samples.routing is not None and len(samples.routing) == len(samples)
    model = moe_worker.model
    for prompt, response, routing in zip(samples.prompt_ids, samples.response_ids, samples.routing):
        tokens = prompt + response
        assert routing.dtype == torch.uint8
        assert routing.shape == (len(tokens), 2, 2)  # 2 MoE layers, top-2
        with torch.no_grad(), record_routing(model) as record:
            model(input_ids=torch.tensor([tokens]))
        own = record.take()
        # The last token was never fed back: its routing is zeros and scores nothing.
        assert torch.equal(routing[:-1], own[:-1])
        assert not routing[-1].any()


def test_no_routing_unless_asked(moe_worker):
    from posttrain_hf_infer import engine

    request = GenerationRequest(prompt_ids=PROMPTS[:1], sampling=SamplingParams(max_new_tokens=2))
    assert engine.generate(moe_worker, request).routing is None


def test_a_reference_replays_the_rollouts_routing(moe_worker):
    from posttrain.config.sections import AlgorithmConfig
    from posttrain.protocol import build_sequence_batch
    from posttrain_hf_infer import engine

    sampling = SamplingParams(n=2, max_new_tokens=3, ignore_eos=True)
    request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=5, return_routing=True)
    samples = engine.generate(moe_worker, request)
    batch = build_sequence_batch(
        samples.prompt_ids,
        samples.response_ids,
        0,
        samples.response_logprobs,
        routing=samples.routing,
    )
    mask = batch.response_mask
    moe_worker.algorithm = AlgorithmConfig(routing_replay="rollout")
    try:
        replayed = engine.compute_logprobs(moe_worker, batch) * mask
        shifted = ((batch["routing"].long() + 1) % 8).to(torch.uint8)
        other = engine.compute_logprobs(moe_worker, batch.with_tensors(routing=shifted)) * mask
    finally:
        moe_worker.algorithm = None
    rollout = batch["rollout_logprobs"] * mask
    assert (replayed - rollout).abs().max() < 1e-5
    assert (other - rollout).abs().max() > 1e-2
