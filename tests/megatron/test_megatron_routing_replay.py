"""Routing replay in megatron_train: a tiny Qwen3-MoE at EP2 over gloo (one spawn of 2 ranks;
routing_workers.scenario_routing_replay) uses exactly the replayed experts, in scoring and in an
update with recomputed layers; its log-probs equal transformers' replaying the same ids; the
router still gets a gradient; ``old_policy`` replays the old pass's routing after the routers
moved."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    from megatron_workers import build_hf_model

    from posttrain.testing.spawn import run_ranks

    root = tmp_path_factory.mktemp("megatron-routing")
    model = build_hf_model(str(root / "qwen3_moe"), "qwen3_moe")
    run_ranks("routing_workers:scenario_routing_replay", 2, str(root), timeout=500, model=model)
    return model, [torch.load(root / f"routing_{r}.pt", weights_only=False) for r in range(2)]


def test_megatron_uses_the_replayed_experts(replayed):
    _, ranks = replayed
    for out in ranks:
        # Every router call matched a micro-batch's replayed ids, every (layer, micro-batch) ran.
        misses, hits = out["scoring_check"]
        assert misses == 0 and len(hits) == 2 * 2
        misses, hits = out["update_check"]
        # The update's layers are recomputed in the backward pass: they replay again.
        assert out["update_calls"] == 2 * 2 * 2
        assert misses == 0 and len(hits) == 2 * 2
        # Gradients reach the routers through the gathered probabilities (both updates).
        assert len(out["router_grads"]) == 2 * 2 and min(out["router_grads"]) > 0


def test_replayed_logprobs_match_transformers_replaying_the_same_ids(replayed):
    import transformers

    from posttrain.backend import replay_routing

    path, ranks = replayed
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for out in ranks:
        share, routing = out["share"], out["routing"]
        mask = share.attention_mask[:, 1:].bool()
        with torch.no_grad(), replay_routing(hf, routing):
            logits = hf(input_ids=share.input_ids, attention_mask=share.attention_mask).logits
        ref = logits[:, :-1].log_softmax(-1).gather(-1, share.input_ids[:, 1:, None])[..., 0]
        got, own = out["replayed"][:, 1:], out["own"][:, 1:]
        assert (got - ref)[mask].abs().max().item() < 1e-4
        # The replayed ids are not the routers' own choice: the log-probs moved.
        assert (got - own)[mask].abs().max().item() > 1e-3


def test_old_policy_replays_the_old_pass_routing(replayed):
    _, ranks = replayed
    for out in ranks:
        # The perturbed routers route otherwise by themselves...
        misses, _ = out["perturbed_check"]
        assert misses > 0
        # ...and the update replays the old-policy pass's routing (forward and recompute).
        misses, hits = out["old_policy_check"]
        assert misses == 0 and len(hits) == 2 * 2
