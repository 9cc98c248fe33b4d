"""Chunked log-probs on a GPU, where their element-wise work is compiled (Triton): equal to the
eager path at a real vocabulary's size in bf16. Skipped without a GPU.

Run on the GPU machine: ``python -m pytest -m gpu tests/core/test_chunked_logprobs_gpu.py``.
"""

import pytest
import torch

from posttrain.scoring.chunked_logprobs import chunked_token_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_chunks_equal_the_eager_ones_in_bf16(temperature):
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, vocab = 3000, 256, 151_936
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) / 8).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    grad_logp = torch.randn(tokens, device="cuda", generator=g)
    grad_ent = torch.randn(tokens, device="cuda", generator=g)
    results = {}
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = chunked_token_logprobs(h, w, None, targets, 1024, temperature, fused=fused)
        ((logp * grad_logp).sum() + (ent * grad_ent).sum()).backward()
        results[fused] = (logp, ent, h.grad, w.grad)
    for got, want in zip(results[True][:2], results[False][:2]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # The logits' gradient is rounded to bf16 once per chunk on both paths; the products after
    # it are the same cuBLAS calls.
    for got, want in zip(results[True][2:], results[False][2:]):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
