"""Chunked log-probs (posttrain.scoring.chunked_logprobs, logprob_head) against the full-logits
path: forward values and gradients equal within the dtype's rounding."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2

from posttrain.scoring.chunked_logprobs import chunked_token_logprobs
from posttrain.scoring.logprob_head import chunkable, forward_token_logprobs
from posttrain.scoring.modeling import shifted_entropy, shifted_token_logprobs

N, H, V = 23, 16, 41


def _inputs(dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, targets


def _full(hidden, weight, bias, targets, temperature):
    """The unchunked path: lm_head's logits, then the shifted helpers (one row of N tokens)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = torch.cat([logits, torch.zeros_like(logits[:1])])[None]  # a last row, unused
    ids = torch.cat([targets[:1], targets])[None]  # ids[:, t + 1] is what logits[:, t] scores
    logp = shifted_token_logprobs(logits, ids, temperature)[0, 1:]
    ent = shifted_entropy(logits, temperature)[0, 1:]
    return logp, ent


@pytest.mark.parametrize("chunk", [5, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_float32_forward_and_gradients_equal_full_logits(chunk, temperature, entropy_grad):
    hidden, weight, bias, targets = _inputs(torch.float32, bias=True)
    logp, ent = chunked_token_logprobs(hidden, weight, bias, targets, chunk, temperature)
    full_logp, full_ent = _full(hidden, weight, bias, targets, temperature)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, full_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, full_ent, atol=1e-6, rtol=1e-6)

    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def loss(lp, en):
        return (lp * g_logp).sum() + ((en * g_ent).sum() if entropy_grad else 0.0)

    inputs = (hidden, weight, bias)
    chunked = torch.autograd.grad(loss(logp, ent), inputs)
    full = torch.autograd.grad(loss(full_logp, full_ent), inputs)
    for got, want in zip(chunked, full):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_bfloat16_logits_are_the_heads_so_logprobs_equal():
    hidden, weight, _, targets = _inputs(torch.bfloat16, bias=False)
    logp, ent = chunked_token_logprobs(hidden, weight, None, targets, 6)
    full_logp, full_ent = _full(hidden, weight, None, targets, 1.0)
    torch.testing.assert_close(logp, full_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, full_ent, atol=1e-6, rtol=1e-6)
    # Gradients in bf16: the full path rounds the weight's gradient once, this one per chunk
    # (summed in float32): equal within bf16's rounding.
    chunked = torch.autograd.grad(logp.sum() + ent.sum(), (hidden, weight))
    full = torch.autograd.grad(full_logp.sum() + full_ent.sum(), (hidden, weight))
    for got, want in zip(chunked, full):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_gradcheck_in_float64():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (9,), generator=g)
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_token_logprobs(h, w, b, targets, 4, 0.8), (hidden, weight, bias)
    )


def test_no_entropy_and_frozen_weight():
    hidden, weight, _, targets = _inputs(torch.float32, bias=False)
    weight = weight.detach()  # frozen (LoRA's base): no gradient computed for it
    logp, ent = chunked_token_logprobs(hidden, weight, None, targets, 4, with_entropy=False)
    assert torch.equal(ent, torch.zeros(N))
    (grad,) = torch.autograd.grad(logp.sum(), hidden)
    (want,) = torch.autograd.grad(_full(hidden, weight, None, targets, 1.0)[0].sum(), hidden)
    torch.testing.assert_close(grad, want, atol=2e-6, rtol=1e-5)


def test_chunk_must_be_positive():
    hidden, weight, _, targets = _inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, weight, None, targets, 0)


def _tiny_lm(**overrides):
    return tiny_qwen2(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **overrides,
    )


def _padded_batch():
    from posttrain.protocol import build_sequence_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (3, 5, 2)]
    responses = [torch.randint(1, V, (n,), generator=g).tolist() for n in (6, 2, 4)]
    return build_sequence_batch(prompts, responses, pad_token_id=0)


def test_model_forward_through_the_swapped_head_equals_full_logits():
    model = _tiny_lm()
    batch = _padded_batch()
    out = forward_token_logprobs(model, batch, 4, entropy_grad=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    mask = batch.attention_mask
    want_logp = shifted_token_logprobs(logits, batch.input_ids) * mask
    want_ent = shifted_entropy(logits) * mask
    torch.testing.assert_close(out.logprobs, want_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.entropy, want_ent, atol=1e-6, rtol=1e-6)
    # The head is the model's own again, and gradients reach every weight as the full path's.
    assert "forward" not in model.lm_head.__dict__
    params = [p for p in model.parameters()]
    got = torch.autograd.grad((out.logprobs + out.entropy).sum(), params)
    want = torch.autograd.grad((want_logp + want_ent).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_models_that_transform_logits_keep_the_full_path():
    assert chunkable(_tiny_lm())
    model = _tiny_lm()
    model.config.final_logit_softcapping = 30.0
    assert not chunkable(model)
    # A head whose output the model changes afterwards is caught at the call.
    model = _tiny_lm()
    head_forward = type(model).forward

    def scaled(self, *args, **kwargs):
        out = head_forward(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled.__get__(model)
    with pytest.raises(RuntimeError, match="logprob_chunk_tokens: 0"):
        forward_token_logprobs(model, _padded_batch(), 4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_chunks_compute_what_the_eager_ones_do(temperature):
    """The compiled element-wise work (a GPU's default) against the eager in-place one: values,
    and gradients with the log-probs' term alone, the entropy's alone and both. Compiled here
    on the CPU (inductor's C++); test_chunked_logprobs_gpu.py runs it in Triton."""
    hidden, weight, bias, targets = _inputs(torch.float32, bias=True)
    outputs = {
        fused: chunked_token_logprobs(hidden, weight, bias, targets, 7, temperature, fused=fused)
        for fused in (False, True)
    }
    for got, want in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g = torch.Generator().manual_seed(4)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    for weights in ((g_logp, None), (None, g_ent), (g_logp, g_ent)):
        grads = {}
        for fused, (logp, ent) in outputs.items():
            loss = sum((out * w).sum() for out, w in zip((logp, ent), weights) if w is not None)
            grads[fused] = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
        for got, want in zip(grads[True], grads[False]):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
