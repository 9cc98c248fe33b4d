"""The static decode's one-token attention on a GPU: posttrain's Triton kernel and cuDNN's (KV
heads shared natively) where they serve, and either by the rows, equal to float64 attention as
the grouped SDPA they replace is, and a compiled bf16 decode through each scoring what a forward
pass scores. Skipped without a GPU.

Run on the GPU machine: ``python -m pytest -m gpu tests/hf_infer/test_decode_attention_gpu.py``.
"""

import pytest
import torch

from posttrain.protocol import GenerationRequest, SamplingParams
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import forward_logprob_gap
from posttrain_hf_infer.engine import HFInferState

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
    from posttrain_hf_infer.static_decode import (
        cudnn_sdpa,
        decode_by_rows,
        grouped_sdpa,
        triton_decode,
    )

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
    for attention in (triton_decode, cudnn_sdpa, decode_by_rows, grouped_sdpa):
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

    from posttrain_hf_infer.static_decode import (
        ATTENTION,
        BY_ROWS_ATTENTION,
        CUDNN_ATTENTION,
        TRITON_ATTENTION,
        cudnn_serves,
        step_attention,
        triton_prefers,
        triton_serves,
    )

    model = AutoModelForCausalLM.from_pretrained(head32_model_path).cuda()
    assert not cudnn_serves(model, "cuda")  # fp32: grouped SDPA
    assert not triton_serves(model, "cuda")
    assert step_attention("auto", model, "cuda") == ATTENTION
    model = model.bfloat16()
    assert cudnn_serves(model, "cuda") and triton_serves(model, "cuda")
    assert step_attention("auto", model, "cuda") == BY_ROWS_ATTENTION
    assert step_attention("triton", model, "cuda") == TRITON_ATTENTION
    assert step_attention("cudnn", model, "cuda") == CUDNN_ATTENTION
    assert step_attention("sdpa", model, "cuda") == ATTENTION
    # by the rows: cuDNN's kernel for few, the Triton kernel for many (per SM)
    assert not triton_prefers(1, 2, "cuda") and triton_prefers(4096, 2, "cuda")


@needs_ampere
@pytest.mark.parametrize(
    "attention, name",
    [
        ("triton", "TRITON_ATTENTION"),
        ("cudnn", "CUDNN_ATTENTION"),
        ("auto", "BY_ROWS_ATTENTION"),
        ("sdpa", "ATTENTION"),
    ],
)
def test_compiled_bf16_decode_scores_what_a_forward_pass_scores(
    head32_model_path, hf_infer_loader, attention, name
):
    """Sampled, several windows (their bucket made small), through each attention: every
    sample's log-probs are a bf16 forward pass's over its prompt and response."""
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer import static_decode

    worker = hf_infer_loader(
        head32_model_path, "cuda", dtype="bf16", decode="compiled", decode_attention=attention
    )
    sampling = SamplingParams(n=4, max_new_tokens=40, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_decode, "WINDOW_BUCKET", 16)
        request = GenerationRequest(prompt_ids=PROMPTS[:3], sampling=sampling, seed=5)
        out = hf_infer.generate(worker, request)
        (decoder,) = worker.engine_state(HFInferState).decoders._decoders.values()
    assert decoder.attention == getattr(static_decode, name)
    assert len(decoder.graphs) > 1  # windows of 16 slots
    # bf16 logits: about 2^-8 of their size apart
    assert forward_logprob_gap(worker.model, out) < 0.05


@needs_ampere
def test_auto_takes_either_kernel_by_the_rows_from_one_compile(
    head32_model_path, hf_infer_loader, monkeypatch
):
    """ "auto" picks the kernel as each decoder's graphs are captured, not in the compiled step:
    a decoder of few rows (cuDNN's) and then one of many (the Triton kernel) share one compile
    (a choice inside the step was one of its guards, and the other kernel compiled it again).
    Both score what a forward pass scores."""
    from torch._dynamo.utils import counters

    from posttrain_hf_infer import decode_attention_kernel, static_decode
    from posttrain_hf_infer import engine as hf_infer

    calls = {"triton": 0, "cudnn": 0}

    def counted(kernel, function):
        def call(*args):
            calls[kernel] += 1
            return function(*args)

        return call

    triton_kernel = counted("triton", decode_attention_kernel.decode_attention)
    monkeypatch.setattr(decode_attention_kernel, "decode_attention", triton_kernel)
    monkeypatch.setattr(
        static_decode, "cudnn_one_token", counted("cudnn", static_decode.cudnn_one_token)
    )
    worker = hf_infer_loader(head32_model_path, "cuda", dtype="bf16", decode="compiled")
    sampling = SamplingParams(n=1, max_new_tokens=12, ignore_eos=True)
    torch._dynamo.reset()  # the earlier tests' compiles count towards the recompile limit
    graphs = [counters["stats"]["unique_graphs"]]
    # 2 rows, and then 12 (another rows bucket, so new graphs): the threshold set around them
    for prompts, programs_per_sm in ((PROMPTS[:2], 10**6), (PROMPTS[:3] * 4, 0)):
        monkeypatch.setattr(static_decode, "TRITON_PROGRAMS_PER_SM", programs_per_sm)
        request = GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=5)
        out = hf_infer.generate(worker, request)
        assert forward_logprob_gap(worker.model, out) < 0.05
        graphs.append(counters["stats"]["unique_graphs"])
        if programs_per_sm:
            assert calls["cudnn"] > 0 and calls["triton"] == 0
            calls["cudnn"] = 0
    assert calls["triton"] > 0 and calls["cudnn"] == 0
    assert graphs[0] < graphs[1] == graphs[2]  # compiled for the first decoder only
