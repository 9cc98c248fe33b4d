"""Routing replay in megatron_train: a tiny Qwen3-MoE at EP2 over gloo (one spawn of 2 ranks;
routing_workers.scenario_routing_replay) uses exactly the replayed experts, in scoring and in an
update with recomputed layers; its log-probs equal transformers' replaying the same ids; the
router still gets a gradient; ``old_policy`` replays the old pass's routing after the routers
moved. Extended: the same replay, and the old-policy pass's recording, under TP2 + SP (a
tiny Mixtral), with packed sequences, and CP2.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from megatron_workers import build_hf_model

    return build_hf_model(str(tmp_path_factory.mktemp("qwen3_moe") / "model"), "qwen3_moe")


@pytest.fixture(scope="module")
def replayed(tmp_path_factory, moe_path):
    from posttrain.testing.spawn import run_ranks

    root = tmp_path_factory.mktemp("megatron-routing")
    model = moe_path
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

    path, ranks = replayed
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for out in ranks:
        share = out["share"]
        mask = share.attention_mask[:, 1:].bool()
        got, own = out["replayed"][:, 1:], out["own"][:, 1:]
        assert (got - _hf_logprobs(hf, share, out["routing"]))[mask].abs().max().item() < 1e-4
        # The replayed ids are not the routers' own choice: the log-probs moved.
        assert (got - own)[mask].abs().max().item() > 1e-3


def _hf_logprobs(hf, share, routing):
    """transformers' log-probs of each row's next tokens, replaying ``routing``."""
    from posttrain.backend import replay_routing

    with torch.no_grad(), replay_routing(hf, routing):
        logits = hf(input_ids=share.input_ids, attention_mask=share.attention_mask).logits
    return logits[:, :-1].log_softmax(-1).gather(-1, share.input_ids[:, 1:, None])[..., 0]


def test_old_policy_replays_the_old_pass_routing(replayed):
    _, ranks = replayed
    for out in ranks:
        # The perturbed routers route otherwise by themselves...
        misses, _ = out["perturbed_check"]
        assert misses > 0
        # ...and the update replays the old-policy pass's routing (forward and recompute).
        misses, hits = out["old_policy_check"]
        assert misses == 0 and len(hits) == 2 * 2


# TP needs sequence parallelism for MoE, which the CPU's torch norms refuse for Qwen3's q/k
# norms: a tiny Mixtral runs it, compared with its own TP1 run (its megatron logits are not
# transformers' to 1e-4 on this converter path, with or without replay). The allgather dispatcher
# (the CPU's) refuses pipeline parallelism's variable sequence lengths.
LAYOUTS = {
    "cp2": ("qwen3_moe", {"context_parallel_size": 2}, 2),
    "mixtral_tp1": ("mixtral", {}, 1),
    "mixtral_tp2_sp": ("mixtral", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
    "mixtral_tp2_sp_packed": (
        "mixtral",
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "pack_sequences": True},
        2,
    ),
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, moe_path):
    """``runs(tag)``: each rank's results of LAYOUTS[tag], run once on first use."""
    from routing_workers import build_mixtral

    from posttrain.testing.spawn import run_ranks

    root = tmp_path_factory.mktemp("megatron-routing-layouts")
    paths = {"qwen3_moe": moe_path}
    done: dict[str, list[dict]] = {}

    def run(tag: str) -> list[dict]:
        if tag not in done:
            arch, layout, world = LAYOUTS[tag]
            if arch not in paths:
                paths[arch] = build_mixtral(str(root / arch))
            run_ranks(
                "routing_workers:scenario_routing_layout",
                world,
                str(root),
                timeout=500,
                model=paths[arch],
                layout=layout,
                tag=tag,
            )
            done[tag] = [
                torch.load(root / f"layout_{tag}_{r}.pt", weights_only=False) for r in range(world)
            ]
        return done[tag]

    return run


def _real(out: dict) -> torch.Tensor:
    return out["share"].attention_mask.bool()


@pytest.mark.extended
def test_replay_and_record_under_context_parallelism(layout_runs, moe_path):
    import math

    import transformers

    from posttrain.backend import record_routing

    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    for out in layout_runs("cp2"):
        share, real = out["share"], _real(out)
        # Each token replays its own routing: the log-probs are transformers' replaying it.
        got = out["replayed"][:, 1:]
        ref = _hf_logprobs(hf, share, out["routing"])
        assert (got - ref)[real[:, 1:]].abs().max().item() < 1e-4
        assert math.isfinite(out["grad_norm"])
        # The old-policy pass's routing, put back together from both CP ranks' chunks, is the
        # routers' own choice (transformers' on the same weights).
        with torch.no_grad(), record_routing(hf) as record:
            hf(input_ids=share.input_ids, attention_mask=share.attention_mask)
        own = record.take().view(*share.input_ids.shape, 2, 2).long().sort(-1).values
        recorded = out["recorded"].long().sort(-1).values
        assert torch.equal(recorded[real], own[real])


@pytest.mark.extended
@pytest.mark.parametrize("tag", ["mixtral_tp2_sp", "mixtral_tp2_sp_packed"])
def test_replay_and_record_under_sequence_parallelism(layout_runs, tag):
    """TP2 + SP (padded and packed rows): each TP rank's share of the sequence replays its
    tokens' routing, and the recorded routing is put back together, as at TP1."""
    import math

    (ref,) = layout_runs("mixtral_tp1")
    for out in layout_runs(tag):
        real = _real(out)
        assert (out["replayed"] - ref["replayed"])[real].abs().max().item() < 1e-5
        assert torch.equal(out["recorded"][real], ref["recorded"][real])
        assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
        assert math.isfinite(out["grad_norm"])
