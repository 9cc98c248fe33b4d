"""The static decode's one-token attention on a GPU: cuDNN's kernel (KV heads shared natively)
where it serves, equal to the grouped SDPA it replaces, and a compiled bf16 decode through it
scoring what a forward pass scores. Skipped without a GPU.

Run on the GPU machine: ``python -m pytest -m gpu tests/core/test_decode_attention_gpu.py``.
"""

import pytest
import torch

from posttrain.protocol import GenerationRequest, SamplingParams
from posttrain.testing.batches import PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]
# cuDNN's fused attention needs an Ampere GPU or later: before, grouped SDPA serves (the kit's
# CUDA tests cover it).
AMPERE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
needs_ampere = pytest.mark.skipif(not AMPERE, reason="cuDNN's attention needs sm80+")


@needs_ampere
@pytest.mark.parametrize("window", [128, 384])
def test_cudnn_attention_equals_grouped_sdpa(window):
    """1.5B's heads (12 queries over 2 KV heads of 128), a window short of the cache, rows
    seeing different slots; both against float64 attention."""
    from posttrain.backends.static_decode import cudnn_sdpa, grouped_sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, slots = 16, 512
    query = torch.randn(rows, 12, 1, 128, device="cuda", generator=g).bfloat16()
    key = torch.randn(rows, 2, slots, 128, device="cuda", generator=g).bfloat16()
    value = torch.randn(rows, 2, slots, 128, device="cuda", generator=g).bfloat16()
    seen = torch.rand(rows, window, device="cuda", generator=g) > 0.3
    seen[:, 0] = True
    mask = torch.where(seen, 0.0, torch.finfo(torch.bfloat16).min).bfloat16()[:, None, None]
    scale = 128**-0.5
    scores = torch.einsum(
        "bkgd,bksd->bkgs", query.double().view(rows, 2, 6, 128), key[:, :, :window].double()
    )
    weights = torch.softmax(scores * scale + mask.double(), dim=-1)
    expected = torch.einsum("bkgs,bksd->bkgd", weights, value[:, :, :window].double())
    expected = expected.reshape(rows, 1, 12, 128)
    for attention in (cudnn_sdpa, grouped_sdpa):
        out, _ = attention(None, query, key, value, mask, scale)
        assert out.shape == expected.shape
        assert torch.allclose(out.double(), expected, atol=2e-2), attention.__name__


@pytest.fixture(scope="module")
def head32_model_path(posttrain_cache):
    """Heads of 32 (``preset:tiny-qwen2-head32``): real models' are 64 or 128."""
    from posttrain.tasks.presets import preset_path

    return preset_path("preset:tiny-qwen2-head32")


@needs_ampere
def test_cudnn_serves_bf16_not_fp32(head32_model_path):
    from transformers import AutoModelForCausalLM

    from posttrain.backends.static_decode import cudnn_serves

    model = AutoModelForCausalLM.from_pretrained(head32_model_path).cuda()
    assert not cudnn_serves(model, 16, "cuda")  # fp32: grouped SDPA
    assert cudnn_serves(model.bfloat16(), 16, "cuda")


@needs_ampere
@pytest.mark.parametrize("cudnn", [True, False], ids=["cudnn", "cudnn_attention-off"])
def test_compiled_bf16_decode_scores_what_a_forward_pass_scores(
    head32_model_path, hf_infer_loader, cudnn
):
    """Sampled, several windows (their bucket made small), through cuDNN's attention (or,
    ``cudnn_attention`` off, grouped SDPA): every sample's log-probs are a bf16 forward pass's
    over its prompt and response."""
    from posttrain.backends import hf_infer, static_decode

    worker = hf_infer_loader(
        head32_model_path, "cuda", dtype="bf16", decode="compiled", cudnn_attention=cudnn
    )
    sampling = SamplingParams(n=4, max_new_tokens=40, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_decode, "WINDOW_BUCKET", 16)
        request = GenerationRequest(prompt_ids=PROMPTS[:3], sampling=sampling, seed=5)
        out = hf_infer.generate(worker, request)
        (decoder,) = worker.state["decoders"]._decoders.values()
    assert decoder.attention == (
        static_decode.CUDNN_ATTENTION if cudnn else static_decode.ATTENTION
    )
    assert len(decoder.graphs) > 1  # windows of 16 slots
    worst = 0.0
    for prompt, response, logps in zip(out.prompt_ids, out.response_ids, out.response_logprobs):
        ids = torch.tensor([prompt + response], device="cuda")
        logits = worker.model(input_ids=ids).logits[0, :-1].float()
        scored = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        worst = max(worst, (scored[len(prompt) - 1 :].cpu() - torch.tensor(logps)).abs().max())
    assert worst < 0.05  # bf16 logits: about 2^-8 of their size apart
