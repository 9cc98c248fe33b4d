"""hf_infer rolls out a vision-language model (preset:tiny-qwen2-vl): the prefill sees each
prompt's images, and every sampled token's log-prob is the one a whole-sample forward pass with
the images gives it; a fixed-shape decode mode falls back to the dynamic cache for them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("posttrain_hf_infer")

from posttrain import GenerationRequest, SamplingParams  # noqa: E402

VLM = "preset:tiny-qwen2-vl"


@pytest.fixture(scope="module", params=["dynamic", "static"])
def vlm_worker(request, hf_infer_loader):
    return hf_infer_loader(VLM, batch_size=2, decode=request.param)


def _prompts(worker):
    from posttrain.tasks.vision import count_shapes, load_image_processor, process_prompt
    from posttrain_hf_infer import engine

    tokenizer = engine._tokenizer(worker)
    processor = load_image_processor(tokenizer)
    records = count_shapes(3, seed=5)
    # Text before the image in one prompt: rows of different lengths, left padding differs.
    texts = ["1+2=" + records[0]["prompt"], records[1]["prompt"], records[2]["prompt"]]
    return tokenizer, [
        process_prompt(text, record["images"], tokenizer, processor)
        for text, record in zip(texts, records)
    ]


def test_sampled_log_probs_are_a_forward_pass_with_the_images(vlm_worker):
    from posttrain.backend import model_inputs
    from posttrain.protocol import build_sequence_batch
    from posttrain_hf_infer import engine

    tokenizer, prompts = _prompts(vlm_worker)
    request = GenerationRequest(
        prompt_ids=[ids for ids, _ in prompts],
        images=[images for _, images in prompts],
        sampling=SamplingParams(n=2, max_new_tokens=5, ignore_eos=True),
        seed=7,
    )
    samples = engine.generate(vlm_worker, request)
    assert engine._state(vlm_worker).decode_served == "dynamic"
    assert samples.images == [images for _, images in prompts for _ in range(2)]
    batch = build_sequence_batch(
        samples.prompt_ids,
        samples.response_ids,
        tokenizer.pad_token_id,
        samples.response_logprobs,
        images=samples.images,
    )
    with torch.no_grad():
        logits = vlm_worker.model(
            **model_inputs(vlm_worker.model, batch),
            attention_mask=batch.attention_mask,
            use_cache=False,
        ).logits
    own = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])
    mask = batch.response_mask[:, 1:]
    gap = ((own[..., 0] - batch["rollout_logprobs"][:, 1:]).abs() * mask).max()
    assert gap < 1e-5
