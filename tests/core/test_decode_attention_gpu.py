"""The static decode's one-token attention on a GPU: posttrain's Triton kernel and cuDNN's (KV
heads shared natively) where they serve, equal to float64 attention as the grouped SDPA they
replace is, and a compiled bf16 decode through each scoring what a forward pass scores. Skipped
without a GPU.

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
@pytest.mark.parametrize(
    "heads, kv_heads, dim, window",
    [(12, 2, 128, 16), (12, 2, 128, 128), (12, 2, 128, 384), (16, 16, 64, 200), (14, 2, 64, 100)],
)
def test_step_attentions_equal_float64_attention(heads, kv_heads, dim, window):
    """1.5B's heads and others (query heads a KV head: 6, 1, 7), windows short of the cache and
    not a multiple of a block, rows seeing scattered slots, a row's last seen slot early in the
    window, a row seeing one slot; each kernel within bf16's rounding of float64 attention."""
    from posttrain.backends.static_decode import cudnn_sdpa, grouped_sdpa, triton_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, slots = 16, 512
    query = torch.randn(rows, heads, 1, dim, device="cuda", generator=g).bfloat16()
    key = torch.randn(rows, kv_heads, slots, dim, device="cuda", generator=g).bfloat16()
    value = torch.randn(rows, kv_heads, slots, dim, device="cuda", generator=g).bfloat16()
    seen = torch.rand(rows, window, device="cuda", generator=g) > 0.3
    seen[:, 0] = True
    seen[1, window // 3 :] = False
    seen[2, :] = False
    seen[2, window // 2] = True
    mask = torch.where(seen, 0.0, torch.finfo(torch.bfloat16).min).bfloat16()[:, None, None]
    scale = dim**-0.5
    groups = heads // kv_heads
    scores = torch.einsum(
        "bkgd,bksd->bkgs",
        query.double().view(rows, kv_heads, groups, dim),
        key[:, :, :window].double(),
    )
    weights = torch.softmax(scores * scale + mask.double(), dim=-1)
    expected = torch.einsum("bkgs,bksd->bkgd", weights, value[:, :, :window].double())
    expected = expected.reshape(rows, 1, heads, dim)
    for attention in (triton_decode, cudnn_sdpa, grouped_sdpa):
        out, _ = attention(None, query, key, value, mask, scale)
        assert out.shape == expected.shape
        assert torch.allclose(out.double(), expected, atol=2e-2), attention.__name__


@pytest.fixture(scope="module")
def head32_model_path(posttrain_cache):
    """Heads of 32 (``preset:tiny-qwen2-head32``): real models' are 64 or 128."""
    from posttrain.tasks.presets import preset_path

    return preset_path("preset:tiny-qwen2-head32")


@needs_ampere
def test_the_kernels_serve_bf16_not_fp32(head32_model_path):
    from transformers import AutoModelForCausalLM

    from posttrain.backends.static_decode import (
        ATTENTION,
        CUDNN_ATTENTION,
        TRITON_ATTENTION,
        cudnn_serves,
        step_attention,
        triton_serves,
    )

    model = AutoModelForCausalLM.from_pretrained(head32_model_path).cuda()
    assert not cudnn_serves(model, 16, "cuda")  # fp32: grouped SDPA
    assert not triton_serves(model, "cuda")
    assert step_attention("auto", model, 16, "cuda") == ATTENTION
    model = model.bfloat16()
    assert cudnn_serves(model, 16, "cuda") and triton_serves(model, "cuda")
    # "auto": cuDNN's kernel for few rows, the Triton kernel for many (per SM)
    assert step_attention("auto", model, 1, "cuda") == CUDNN_ATTENTION
    assert step_attention("auto", model, 4096, "cuda") == TRITON_ATTENTION
    assert step_attention("triton", model, 1, "cuda") == TRITON_ATTENTION
    assert step_attention("cudnn", model, 4096, "cuda") == CUDNN_ATTENTION
    assert step_attention("sdpa", model, 4096, "cuda") == ATTENTION


@needs_ampere
@pytest.mark.parametrize(
    "attention, name",
    [("triton", "TRITON_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("sdpa", "ATTENTION")],
)
def test_compiled_bf16_decode_scores_what_a_forward_pass_scores(
    head32_model_path, hf_infer_loader, attention, name
):
    """Sampled, several windows (their bucket made small), through each attention: every
    sample's log-probs are a bf16 forward pass's over its prompt and response."""
    from posttrain.backends import hf_infer, static_decode
    from posttrain.scoring.modeling import shifted_token_logprobs

    worker = hf_infer_loader(
        head32_model_path, "cuda", dtype="bf16", decode="compiled", decode_attention=attention
    )
    sampling = SamplingParams(n=4, max_new_tokens=40, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_decode, "WINDOW_BUCKET", 16)
        request = GenerationRequest(prompt_ids=PROMPTS[:3], sampling=sampling, seed=5)
        out = hf_infer.generate(worker, request)
        (decoder,) = worker.state["decoders"]._decoders.values()
    assert decoder.attention == getattr(static_decode, name)
    assert len(decoder.graphs) > 1  # windows of 16 slots
    worst = 0.0
    for prompt, response, logps in zip(out.prompt_ids, out.response_ids, out.response_logprobs):
        ids = torch.tensor([prompt + response], device="cuda")
        scored = shifted_token_logprobs(worker.model(input_ids=ids).logits, ids)[0]
        worst = max(worst, (scored[len(prompt) :].cpu() - torch.tensor(logps)).abs().max())
    assert worst < 0.05  # bf16 logits: about 2^-8 of their size apart
