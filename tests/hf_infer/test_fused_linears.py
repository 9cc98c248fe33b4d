"""hf_infer's stacked projections (``fused_linears``): one GEMM for a layer's q/k/v and one for its
MLP's gate/up inside the decode's block, the same logits as the model's own forward, weight
syncs landing in the stacked tensor, and the model as before once unfused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2

from posttrain_hf_infer.fused_linears import (
    fuse_sibling_linears,
    stacked_projections,
    unfuse_sibling_linears,
)


@pytest.fixture
def model():
    return tiny_qwen2().eval()


IDS = torch.tensor([[5, 17, 3, 44, 9], [8, 2, 71, 30, 6]])


def linear_calls(model, ids) -> int:
    """The linear ops in the traced forward pass (dynamo's graph, not run through inductor)."""
    counted = []

    def backend(graph_module, inputs):
        nodes = graph_module.graph.nodes
        counted.append(sum(n.op == "call_function" and "linear" in str(n.target) for n in nodes))
        return graph_module

    torch._dynamo.reset()
    torch.compile(lambda m, x: m(x).logits, backend=backend, fullgraph=True)(model, ids)
    return counted[0]


@torch.no_grad()
def test_stacked_projections_run_one_gemm_per_group_and_score_as_before(model):
    expected = model(IDS).logits
    groups = fuse_sibling_linears(model)
    assert [g.sizes for g in groups] == [[64, 32, 32], [128, 128]] * 2
    attention = model.model.layers[1].self_attn
    stacked = groups[2].weight
    assert attention.k_proj.weight.data_ptr() == stacked[64:].data_ptr()
    assert "model.layers.1.self_attn.k_proj.weight" in model.state_dict()
    # Outside the block every projection runs its own GEMM (7 a layer and the head).
    assert linear_calls(model, IDS) == 15
    with stacked_projections(groups):
        # q/k/v as one, o, gate/up as one, down: 4 a layer.
        assert linear_calls(model, IDS) == 9
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=1e-5)
        # A projection called on an input its group did not see computes its own output.
        other = torch.randn(3, 64)
        torch.testing.assert_close(
            attention.v_proj(other), other @ attention.v_proj.weight.T + attention.v_proj.bias
        )
    assert all(g.pending is None and not g.active for g in groups)
    # A weight sync copies into the parameters: the stacked tensor has the new weights.
    new = torch.randn_like(attention.k_proj.weight)
    dict(model.state_dict(keep_vars=True))["model.layers.1.self_attn.k_proj.weight"].copy_(new)
    assert torch.equal(stacked[64:96], new)
    expected = model(IDS).logits
    with stacked_projections(groups):
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_unfused_projections_compute_their_own_and_stack_again(model):
    groups = fuse_sibling_linears(model)
    assert fuse_sibling_linears(model) == groups  # stacked once
    unfuse_sibling_linears(model)
    with stacked_projections(groups):
        assert linear_calls(model, IDS) == 15
    model.to(torch.float64)  # a move: every parameter its own storage again
    expected = model(IDS).logits
    again = fuse_sibling_linears(model)
    assert again[0] is not groups[0] and again[0].weight.dtype == torch.float64
    with stacked_projections(again):
        torch.testing.assert_close(model(IDS).logits, expected, rtol=0, atol=1e-9)


@torch.no_grad()
def test_projections_sharing_a_parameter_stay_apart(model):
    """A weight two layers share is not stacked into either (a sync would reach one copy)."""
    layers = model.model.layers
    layers[1].self_attn.k_proj.weight = layers[0].self_attn.k_proj.weight
    assert [g.sizes for g in fuse_sibling_linears(model)] == [[128, 128]] * 2
