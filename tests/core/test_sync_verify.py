"""The weight sync's proof (posttrain.weight_sync.verify): byte sums exact per tensor, which
buckets each policy sums, and a received bucket that differs named tensor by tensor."""

from __future__ import annotations

import pytest
import torch

from posttrain.protocol import WeightBucket
from posttrain.weight_sync.verify import (
    SyncState,
    WeightSyncMismatch,
    begin_sync,
    byte_sums,
    checked,
    with_digests,
)


def test_byte_sums_are_the_sums_of_the_words_or_bytes():
    a = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)  # 4 bytes: one int32 word
    b = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    c = torch.tensor([7, 8, 9], dtype=torch.uint8)  # 3 bytes: summed byte by byte
    assert byte_sums([a, b, c]) == [int(a.view(torch.int32)), sum(range(6)), 24]
    assert byte_sums([]) == []


def test_byte_sums_do_not_depend_on_where_a_tensor_sits():
    """A received tensor may sit at any offset of its bucket's buffer; its sum must be the
    sender's (the choice of words or bytes follows the size alone)."""
    sent = torch.randn(6, dtype=torch.bfloat16)
    buffer = torch.zeros(20, dtype=torch.uint8)
    received = buffer[2:14].view(torch.bfloat16)  # 2 bytes in: not on a word boundary
    received.copy_(sent)
    assert byte_sums([received]) == byte_sums([sent])
    flipped = received.clone()
    flipped.view(torch.uint8)[5] ^= 1
    assert byte_sums([flipped]) != byte_sums([sent])


def buckets(n: int) -> list[WeightBucket]:
    return [WeightBucket([(f"w{i}", torch.full((3,), float(i)))]) for i in range(n)]


@pytest.mark.parametrize(
    ("verify", "summed"),
    [
        ("every", [[0, 1, 2], [0, 1, 2], [0, 1, 2]]),
        ("first", [[0, 1, 2], [0], [1], [2], [0]]),
        ("off", [[], []]),
    ],
)
def test_which_buckets_each_policy_sums(verify, summed):
    state = SyncState()
    for expected in summed:
        begin_sync(state, verify)
        out = list(with_digests(state, buckets(3)))
        assert [i for i, b in enumerate(out) if b.digests is not None] == expected


def test_a_bucket_that_changed_on_the_way_is_named():
    state = SyncState()
    begin_sync(state, "every")
    sent = list(with_digests(state, buckets(2)))
    sent[1].tensors[0] = ("w1", sent[1].tensors[0][1] + 1)
    received = checked(state, sent, "actor_infer (hf_infer) rank 0")
    assert next(received) is sent[0]
    with pytest.raises(
        WeightSyncMismatch, match=r"rank 0: 1 of the bucket's 1 tensors .*: w1 \(sent"
    ):
        next(received)


def test_a_renamed_or_reshaped_weight_is_named_with_the_engines_own():
    shapes = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,)}

    def received(*tensors):
        bucket = WeightBucket(list(tensors))
        bucket.digests = byte_sums(t for _, t in bucket.tensors)
        return [bucket]

    def import_(*tensors):
        buckets = checked(
            SyncState(), received(*tensors), "actor_infer (hf_infer) rank 0", lambda: shapes
        )
        return list(buckets)

    assert list(
        checked(SyncState(), received(("x", torch.ones(2))), "r", lambda: None)
    )  # unchecked
    # The tied head, sent by name, is the embedding's.
    assert import_(("lm_head.weight", torch.ones(8, 4)), ("model.norm.weight", torch.ones(4)))
    with pytest.raises(WeightSyncMismatch) as renamed:
        import_(("model.renamed.norm.weight", torch.ones(4)))
    assert (
        "sent model.renamed.norm.weight [4], a name the engine lacks (the engine's closest "
        "weight of that shape: model.norm.weight)" in str(renamed.value)
    )
    with pytest.raises(WeightSyncMismatch) as reshaped:
        import_(("model.norm.weight", torch.ones(5)))
    assert "model.norm.weight: sent [5], the engine's is [4]" in str(reshaped.value)
