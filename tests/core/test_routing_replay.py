"""Routing replay over transformers' MoE routers (posttrain.training.routing_replay): replaying
the recorded experts reproduces the forward bitwise, other ids change it and are the experts
used, and the router still learns."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posttrain.backend import (  # noqa: E402
    model_experts,
    moe_routers,
    record_routing,
    replay_routing,
)
from posttrain.errors import UserError  # noqa: E402

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _qwen3_moe():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **SIZES,
        head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        **SIZES, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request):
    return _qwen3_moe() if request.param == "qwen3_moe" else _mixtral()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, SIZES["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(1))


def _experts_used(model):
    """Per MoE layer, the top-k ids its experts module is called with."""
    used = []
    handles = [
        r_parent.experts.register_forward_pre_hook(lambda m, args: used.append(args[1].clone()))
        for r_parent in model.modules()
        if hasattr(r_parent, "experts") and hasattr(r_parent, "gate")
    ]
    return used, handles


def test_replaying_the_recorded_routing_is_bitwise_the_same_forward(model, ids):
    with torch.no_grad(), record_routing(model) as record:
        want = model(input_ids=ids).logits
    routing = record.take()
    layers = len(moe_routers(model))
    assert routing.dtype == torch.uint8
    assert routing.shape == (ids.numel(), layers, 2)
    with torch.no_grad(), replay_routing(model, routing):
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)


def test_replayed_ids_are_the_experts_used_and_change_the_output(model, ids):
    with torch.no_grad(), record_routing(model) as record:
        want = model(input_ids=ids).logits
    routing = record.take()
    experts = moe_routers(model)[0].num_experts
    other = ((routing.long() + 1) % experts).to(routing.dtype)  # distinct ids, all different
    used, handles = _experts_used(model)
    try:
        with torch.no_grad(), replay_routing(model, other):
            got = model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.allclose(got, want)
    assert len(used) == other.shape[1]
    for layer, chosen in enumerate(used):
        assert torch.equal(chosen, other[:, layer].long())


def test_the_router_learns_through_the_replayed_gates(model, ids):
    with torch.no_grad(), record_routing(model) as record:
        model(input_ids=ids)
    routing = record.take()
    model.zero_grad(set_to_none=True)
    with replay_routing(model, routing.reshape(*ids.shape, *routing.shape[1:])):
        model(input_ids=ids).logits.square().mean().backward()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_replay_changes_between_calls_and_checks_shapes(model, ids):
    with torch.no_grad(), record_routing(model) as record:
        model(input_ids=ids[:1])
        model(input_ids=ids[1:])
    routing = record.take()
    assert routing.shape[0] == ids.numel()  # two calls, in order
    with torch.no_grad(), replay_routing(model) as replay:
        replay.use(routing[: ids.shape[1]])
        model(input_ids=ids[:1])
        with pytest.raises(RuntimeError, match="tokens of routing"):
            model(input_ids=ids)


def test_a_dense_model_is_refused():
    from tiny_models import tiny_qwen2

    with pytest.raises(UserError, match="no mixture-of-experts"), record_routing(tiny_qwen2()):
        pass


def test_experts_are_read_from_config_without_loading(tmp_path):
    assert model_experts("preset:tiny-qwen3-moe") == 8
    assert model_experts("preset:tiny-qwen2") == 0
    (tmp_path / "config.json").write_text('{"model_type": "mixtral", "num_local_experts": 8}')
    assert model_experts(str(tmp_path)) == 8
    assert model_experts(str(tmp_path / "nowhere")) is None


def test_routing_travels_with_samples_and_batches():
    from posttrain.protocol import RolloutSamples, SequenceBatch, build_sequence_batch

    def routed(prompt, response, expert):
        return torch.full((len(prompt) + len(response), 2, 2), expert, dtype=torch.uint8)

    a = RolloutSamples(
        prompt_ids=[[1, 2], [3]],
        response_ids=[[4], [5, 6, 7]],
        response_logprobs=[[0.0], [0.0] * 3],
        routing=[routed([1, 2], [4], 1), routed([3], [5, 6, 7], 2)],
    )
    empty = RolloutSamples(prompt_ids=[], response_ids=[], response_logprobs=[])
    samples = RolloutSamples.concat([a, empty]).select([1, 0])
    assert [r.shape[0] for r in samples.routing] == [4, 3]
    batch = build_sequence_batch(
        samples.prompt_ids, samples.response_ids, 0, routing=samples.routing
    )
    routing = batch["routing"]
    assert routing.shape == (2, 4, 2, 2) and routing.dtype == torch.uint8
    assert routing[0].eq(2).all() and routing[1, :3].eq(1).all() and not routing[1, 3].any()
    short = batch.select([1]).trimmed()
    assert short["routing"].shape == (1, 3, 2, 2)
    joined = SequenceBatch.concat([short, batch.select([0])])
    assert joined["routing"].shape == (2, 4, 2, 2)
    assert torch.equal(joined["routing"][1], routing[0])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_routing_survives_a_json_record_bitwise(dtype):
    import json

    from posttrain.protocol import routing_from_record, routing_record

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 200, (n, 3, 2), generator=g).to(dtype) for n in (5, 1, 7)]
    back = routing_from_record(json.loads(json.dumps(routing_record(rows))))
    assert all(b.dtype == dtype and torch.equal(a, b) for a, b in zip(rows, back, strict=True))


def test_validate_refuses_replay_where_a_strategy_or_the_samples_cannot_carry_it(
    fake_train_host, model_dir, tmp_path
):
    """A trainer that does not replay, and (for rollout) samples made in segments or turns,
    are refused together, each naming what to set instead."""
    from posttrain.config.report import ErrorReport
    from posttrain.loading.workflow import build_workflow

    raw = {
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "algorithm": {
            "group_size": 4,
            "rollout_batch_size": 8,
            "routing_replay": "rollout",
            "partial_rollout": True,
            "max_staleness": 1,
        },
        "environment": {"name": "calculator"},
        "actor_train": {
            "strategy_args": {"strategy_name": "contract_fake_train"},
            "device_mapping": [0],
            "training_args": {"learning_rate": 1.0e-6},
        },
        "actor_infer": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": [1],
            "generating_args": {"max_new_tokens": 16},
        },
    }
    _, report = build_workflow(raw, fake_train_host, ErrorReport(), base_dir=str(tmp_path))
    found = [e.render() for e in report.errors if e.path == "algorithm.routing_replay"]
    assert len(found) == 3, found
    assert "actor_train's strategy 'contract_fake_train'" in found[0]
    assert "'rollout' with algorithm.partial_rollout: true" in found[1]
    assert "'rollout' with environment.name 'calculator'" in found[2]
    assert all("routing_replay: old_policy" in e or "posttrain plugins" in e for e in found)
