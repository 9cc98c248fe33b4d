"""Micro-batch and data-parallel partitioning helpers (fast, no processes)."""

from __future__ import annotations

import random

import pytest

from posttrain.training.micro_batching import (
    balance_across_ranks,
    fixed_micro_batches,
    karmarkar_karp,
    sequence_lengths,
    token_budget_micro_batches,
)

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`


def _flat(parts):
    return sorted(i for p in parts for i in p)


def test_fixed_micro_batches_are_contiguous_chunks():
    assert fixed_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_micro_batches([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]
    assert fixed_micro_batches(0, 4) == []
    with pytest.raises(ValueError):
        fixed_micro_batches(4, 0)


def test_sequence_lengths_of_a_batch():
    torch = pytest.importorskip("torch")
    from posttrain.protocol import SequenceBatch

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    batch = SequenceBatch(
        {"input_ids": mask.clone(), "attention_mask": mask, "response_mask": mask.float()}
    )
    assert sequence_lengths(batch) == [3, 2, 4]
    # Padded to its longest row, no two rows fit 5 tokens.
    assert token_budget_micro_batches(batch, 5) == [[0], [1], [2]]
    assert token_budget_micro_batches(batch, 6) == [[0, 1], [2]]


@pytest.mark.parametrize("seed", range(5))
def test_karmarkar_karp_balances(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(37)]
    parts = karmarkar_karp(lengths, 4)
    assert _flat(parts) == list(range(37))
    sums = [sum(lengths[i] for i in p) for p in parts]
    # Largest differencing leaves a spread no larger than the longest item (usually far less).
    assert max(sums) - min(sums) <= max(lengths)
    # Better than the naive contiguous split on these random inputs.
    naive = [sum(lengths[i::4]) for i in range(4)]
    assert max(sums) - min(sums) <= max(naive) - min(naive)


def test_karmarkar_karp_known_case_and_empty_parts():
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    # The classic example where differencing is not optimal (15/15 exists): 14/16.
    assert sums == [14, 16]
    assert karmarkar_karp([3], 3) == [[0], [], []]
    assert karmarkar_karp([], 2) == [[], []]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_respects_budget_and_covers_all(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(50)]
    parts = token_budget_micro_batches(lengths, 128)
    assert _flat(parts) == list(range(50))
    padded = [len(p) * max(lengths[i] for i in p) for p in parts]
    assert all(size <= 128 for size in padded)
    assert all(p == sorted(p) for p in parts)
    # Not wasteful: close to the lower bound on the count, and little padding computed.
    assert len(parts) <= -(-sum(lengths) // 128) + 4
    assert sum(padded) <= 1.2 * sum(lengths)


def test_token_budget_keeps_a_long_tail_from_padding_the_short_rows():
    # Long-tailed responses: one 4,000-token row among 1,000-token ones.
    lengths = [1000] * 15 + [4000]
    parts = token_budget_micro_batches(lengths, 8192)
    assert [15] in parts  # the long row alone: the short ones are not padded to it
    assert sum(len(p) * max(lengths[i] for i in p) for p in parts) == sum(lengths)


def test_token_budget_long_sequence_alone_and_min_count():
    parts = token_budget_micro_batches([10, 300, 20, 30], 100)
    assert [1] in parts
    assert _flat(parts) == [0, 1, 2, 3]
    assert len(token_budget_micro_batches([10, 10, 10, 10], 100)) == 1
    assert len(token_budget_micro_batches([10, 10, 10, 10], 100, min_micro_batches=3)) == 3
    # Fewer rows than asked: as many micro-batches as rows; the caller pads.
    assert len(token_budget_micro_batches([10, 10], 100, min_micro_batches=4)) == 2
    assert token_budget_micro_batches([], 100) == []


@pytest.mark.parametrize(("n", "ranks"), [(16, 2), (17, 4), (8, 8), (3, 4)])
def test_balance_across_ranks_equal_counts(n, ranks):
    rng = random.Random(n * 31 + ranks)
    lengths = [rng.randint(5, 500) for _ in range(n)]
    parts = balance_across_ranks(lengths, ranks)
    assert len(parts) == ranks
    assert _flat(parts) == list(range(n))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    if n % ranks == 0:
        sums = [sum(lengths[i] for i in p) for p in parts]
        assert max(sums) - min(sums) <= max(lengths)
