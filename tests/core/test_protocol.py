"""SequenceBatch packing and reshaping, row concatenation, and weight bucketing."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from posttrain.protocol import (
    RolloutSamples,
    SequenceBatch,
    WeightBucket,
    bucketize,
    build_sequence_batch,
    concat_tensor_rows,
    fused_group,
)

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`

PROMPTS = [[1, 5, 14], [1, 6], [1, 7, 14, 9], [2]]
RESPONSES = [[4, 5], [6, 7, 8, 9], [10], [11, 12, 13]]


def _batch() -> SequenceBatch:
    batch = build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)
    values = torch.arange(batch.input_ids.numel(), dtype=torch.float32)
    batch = batch.with_tensors(
        values=values.view(batch.input_ids.shape) * batch.attention_mask,
        scores=torch.tensor([0.1, 0.2, 0.3, 0.4]),
    )
    batch.meta["global_tokens"] = 10.0
    return batch


def _assert_same(a: SequenceBatch, b: SequenceBatch) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for key in a.tensors:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key
    assert a.meta == b.meta


def test_build_sequence_batch_masks():
    batch = build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=3)
    assert len(batch) == 4
    assert batch.input_ids.shape == (4, 6)
    assert batch.input_ids.tolist() == [
        [1, 5, 14, 4, 5, 3],
        [1, 6, 6, 7, 8, 9],
        [1, 7, 14, 9, 10, 3],
        [2, 11, 12, 13, 3, 3],
    ]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
    ]
    assert batch.response_mask.tolist() == [
        [0, 0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 0],
        [0, 1, 1, 1, 0, 0],
    ]
    assert batch.input_ids.dtype == torch.long
    assert batch.attention_mask.dtype == torch.long
    assert batch.response_mask.dtype == torch.float32
    assert float(batch.response_mask.sum()) == sum(len(r) for r in RESPONSES)
    assert batch.meta == {}


def test_empty_response_has_no_response_tokens():
    batch = build_sequence_batch([[1, 2], [3]], [[], [4]], pad_token_id=0)
    assert batch.response_mask.tolist() == [[0, 0], [0, 1]]
    assert batch.attention_mask.tolist() == [[1, 1], [1, 1]]


def test_loss_mask_and_turn_rewards_lie_on_their_response_tokens():
    # Row 0: model, model, environment, model; row 1: one model token.
    batch = build_sequence_batch(
        [[1, 2], [3]],
        [[4, 5, 6, 7], [8]],
        pad_token_id=0,
        response_logprobs=[[-0.1, -0.2, 0.0, -0.3], [-0.4]],
        loss_mask=[[1, 1, 0, 1], [1]],
        turn_rewards=[[0.0, 0.5, 0.0, 1.0], [2.0]],
    )
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch["turn_rewards"].tolist() == [[0, 0, 0, 0.5, 0, 1], [0, 2, 0, 0, 0, 0]]
    assert batch["rollout_logprobs"][0, 4] == 0.0


def test_select_and_with_tensors():
    batch = _batch()
    picked = batch.select([2, 0])
    assert picked.input_ids.tolist() == [batch.input_ids[2].tolist(), batch.input_ids[0].tolist()]
    assert picked["scores"].tolist() == pytest.approx([0.3, 0.1])
    assert picked.meta == batch.meta and picked.meta is not batch.meta
    extra = batch.with_tensors(advantages=torch.ones(4, 6))
    assert "advantages" in extra.tensors and "advantages" not in batch.tensors


def test_split_then_concat_round_trips():
    batch = _batch()
    for parts in (1, 2, 4):
        shares = batch.split(parts)
        assert len(shares) == parts
        assert all(len(s) == 4 // parts for s in shares)
        _assert_same(SequenceBatch.concat(shares), batch)
    with pytest.raises(ValueError, match="3 equal shares"):
        batch.split(3)


def test_split_trim_then_concat_pads_back():
    batch = _batch()
    first, second = batch.split(2)  # rows 0,1 (widths 5, 6) and 2,3 (widths 5, 4)
    trimmed = second.trimmed()
    assert trimmed.input_ids.shape == (2, 5)
    assert trimmed["scores"].shape == (2,)
    assert torch.equal(trimmed.input_ids, second.input_ids[:, :5])
    # concat right-pads the narrower batch with zeros: the padding of every tensor here.
    _assert_same(SequenceBatch.concat([first, trimmed]), batch)
    both_trimmed = SequenceBatch.concat([first.trimmed(), trimmed])
    assert both_trimmed.input_ids.shape == (4, 6)


def test_trimmed_drops_only_all_padding_columns():
    batch = build_sequence_batch([[1, 2], [3]], [[4], [5]], pad_token_id=0)
    padded = SequenceBatch(
        {k: torch.nn.functional.pad(v, (0, 4)) for k, v in batch.tensors.items()}
    ).with_tensors(per_sample=torch.tensor([1.0, 2.0]))
    assert padded.input_ids.shape == (2, 7)
    trimmed = padded.trimmed()
    assert trimmed.input_ids.shape == (2, 3)
    for key in batch.tensors:
        assert torch.equal(trimmed[key], batch[key])
    assert torch.equal(trimmed["per_sample"], torch.tensor([1.0, 2.0]))


def test_concat_tensor_rows_pads_to_widest():
    a = torch.tensor([[1.0, 2.0]])
    b = torch.tensor([[3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0]])
    c = torch.tensor([[11.0]])
    out = concat_tensor_rows([a, b, c])
    assert out.tolist() == [
        [1.0, 2.0, 0.0, 0.0],
        [3.0, 4.0, 5.0, 6.0],
        [7.0, 8.0, 9.0, 10.0],
        [11.0, 0.0, 0.0, 0.0],
    ]
    assert torch.equal(concat_tensor_rows([b]), b)


def test_rollout_samples_concat():
    a = RolloutSamples(prompt_ids=[[1]], response_ids=[[2, 3]], response_logprobs=[[-0.1, -0.2]])
    b = RolloutSamples(prompt_ids=[[4], [5]], response_ids=[[6], []], response_logprobs=[[-1], []])
    out = RolloutSamples.concat([a, b])
    assert len(out) == 3
    assert out.prompt_ids == [[1], [4], [5]]
    assert out.response_ids == [[2, 3], [6], []]
    assert out.response_logprobs == [[-0.1, -0.2], [-1], []]
    assert out.loss_mask is None
    # A part from environment episodes keeps its mask; the others' are all ones.
    c = RolloutSamples(
        prompt_ids=[[7]], response_ids=[[8, 9]], response_logprobs=[[-1, 0]], loss_mask=[[1, 0]]
    )
    mixed = RolloutSamples.concat([a, c])
    assert mixed.loss_mask == [[1, 1], [1, 0]]
    assert mixed.select([1]).loss_mask == [[1, 0]]


# -- bucketize ---------------------------------------------------------------------------------


def _qwen_like_weights(layers: int = 3, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """HF Qwen2 names, in module order, with varied sizes (q/k/v with biases)."""
    rng = random.Random(seed)

    def t(*shape):
        return torch.zeros(*[max(1, s + rng.randint(0, 3)) for s in shape])

    out = [("model.embed_tokens.weight", t(19, 8))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", t(8)),
            (f"{p}.self_attn.q_proj.weight", t(8, 8)),
            (f"{p}.self_attn.q_proj.bias", t(8)),
            (f"{p}.self_attn.k_proj.weight", t(4, 8)),
            (f"{p}.self_attn.k_proj.bias", t(4)),
            (f"{p}.self_attn.v_proj.weight", t(4, 8)),
            (f"{p}.self_attn.v_proj.bias", t(4)),
            (f"{p}.self_attn.o_proj.weight", t(8, 8)),
            (f"{p}.post_attention_layernorm.weight", t(8)),
            (f"{p}.mlp.gate_proj.weight", t(16, 8)),
            (f"{p}.mlp.up_proj.weight", t(16, 8)),
            (f"{p}.mlp.down_proj.weight", t(8, 16)),
        ]
    out += [("model.norm.weight", t(8)), ("lm_head.weight", t(19, 8))]
    if seed % 2:  # some float16 / bfloat16 tensors too
        out = [(n, v.to(torch.bfloat16) if "mlp" in n else v) for n, v in out]
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def test_fused_group_names():
    assert fused_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert fused_group("model.layers.3.self_attn.v_proj.bias") == "model.layers.3.self_attn"
    assert fused_group("model.layers.3.mlp.gate_proj.weight") == "model.layers.3.mlp"
    assert fused_group("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp"
    assert fused_group("model.layers.3.mlp.up_proj.weight") != fused_group(
        "model.layers.4.mlp.up_proj.weight"
    )
    assert fused_group("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bucket_bytes", [0, 1, 7, 64, 100, 333, 1000, 1500, 4096, 10**9])
def test_bucketize_properties(seed, bucket_bytes):
    weights = _qwen_like_weights(seed=seed)
    buckets = list(bucketize(iter(weights), bucket_bytes))
    assert all(isinstance(b, WeightBucket) and b for b in buckets)
    # Order kept, every tensor exactly once (the very same tensor objects).
    flat = [pair for b in buckets for pair in b.tensors]
    assert [n for n, _ in flat] == [n for n, _ in weights]
    assert all(a is b for (_, a), (_, b) in zip(flat, weights))
    assert sum(b.nbytes for b in buckets) == _nbytes(weights)
    # No fused group split: q/k/v of a layer, gate/up of a layer share one bucket.
    where = {name: i for i, b in enumerate(buckets) for name, _ in b.tensors}
    for layer in range(3):
        attn = [f"model.layers.{layer}.self_attn.{m}_proj.weight" for m in "qkvo"]
        attn += [f"model.layers.{layer}.self_attn.{m}_proj.bias" for m in "qkv"]
        assert len({where[n] for n in attn}) == 1, (bucket_bytes, attn)
        mlp = [f"model.layers.{layer}.mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        assert len({where[n] for n in mlp}) == 1
    for key, run in itertools.groupby(weights, key=lambda pair: fused_group(pair[0])):
        assert len({where[n] for n, _ in run}) == 1, key
    # A bucket is over budget only when it is a single fused group too big on its own.
    for b in buckets:
        if b.nbytes > bucket_bytes:
            assert len({fused_group(n) for n, _ in b.tensors}) == 1
    # Greedy: a bucket is closed only because the next group would not fit.
    for b, nxt in itertools.pairwise(buckets):
        first_group = next(iter(itertools.groupby(nxt.tensors, lambda p: fused_group(p[0]))))[1]
        assert b.nbytes + _nbytes(first_group) > bucket_bytes
    if bucket_bytes >= _nbytes(weights):
        assert len(buckets) == 1


def test_bucketize_tiny_budget_gives_one_bucket_per_group():
    weights = _qwen_like_weights(layers=2)
    buckets = list(bucketize(weights, 1))
    runs = [k for k, _ in itertools.groupby(weights, key=lambda pair: fused_group(pair[0]))]
    assert len(buckets) == len(runs)
    assert [fused_group(b.tensors[0][0]) for b in buckets] == runs


def test_bucketize_empty():
    assert list(bucketize([], 100)) == []
    assert not WeightBucket()
    assert WeightBucket([("a", torch.zeros(3, dtype=torch.float16))]).nbytes == 6
