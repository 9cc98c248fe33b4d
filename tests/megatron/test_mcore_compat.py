"""mcore_compat's multi-tensor ops replace megatron-core's per-tensor fallbacks (no apex / TE)
and compute the same results."""

from __future__ import annotations

import pytest
import torch

from posttrain_megatron import mcore_compat


def tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in [(5, 3), (7,), (2, 4, 6)]]


def test_fallbacks_are_replaced_when_apex_and_te_are_absent():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if clip_grads.multi_tensor_scale_impl not in (
        utils.local_multi_tensor_scale,
        mcore_compat.foreach_multi_tensor_scale,
    ):
        pytest.skip("apex or TransformerEngine provides the fused multi-tensor ops")
    mcore_compat.apply()
    assert clip_grads.multi_tensor_scale_impl is mcore_compat.foreach_multi_tensor_scale
    assert mcore_optimizer.multi_tensor_scale_impl is mcore_compat.foreach_multi_tensor_scale
    assert clip_grads.l2_norm_impl is mcore_compat.foreach_multi_tensor_l2_norm


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("in_place", [True, False])
def test_scale_equals_megatron_fallback(scale, in_place):
    from megatron.core.utils import local_multi_tensor_scale

    sources = tensors(0)
    ours = sources if in_place else tensors(1, torch.bfloat16)
    theirs_src = [t.clone() for t in sources]
    theirs = theirs_src if in_place else tensors(1, torch.bfloat16)
    mcore_compat.foreach_multi_tensor_scale(0, None, [sources, ours], scale)
    local_multi_tensor_scale(0, None, [theirs_src, theirs], scale)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_l2_norm_equals_megatron_fallback():
    group = tensors(2)
    ours, _ = mcore_compat.foreach_multi_tensor_l2_norm(0, None, [group], False)
    # megatron's local_multi_tensor_l2_norm (which puts its result on "cuda"):
    theirs = torch.norm(torch.tensor([torch.norm(t) for t in group])).reshape(1)
    assert ours.shape == (1,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    empty, _ = mcore_compat.foreach_multi_tensor_l2_norm(0, None, [[]], False)
    assert float(empty) == 0.0
