"""Partitioning sequences into micro-batches and across data-parallel ranks (no torch needed).

Every helper returns lists of row indices into the batch (each list sorted ascending), so a
backend builds micro-batches with ``batch.select(indices)``. Balancing uses the
Karmarkar-Karp largest differencing method on sequence lengths, as verl does for its dynamic
batches: it keeps the longest and shortest partitions close, which evens out both memory and the
time ranks wait for each other.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any


def sequence_lengths(batch: Any) -> list[int]:
    """Token count of every row: ``attention_mask.sum(1)`` of a SequenceBatch, or the lengths
    themselves when given a sequence of ints."""
    if hasattr(batch, "attention_mask"):
        return [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
    return [int(n) for n in batch]


def fixed_micro_batches(batch: Any, size: int) -> list[list[int]]:
    """Contiguous micro-batches of ``size`` rows (the last one may be smaller).

    ``batch`` is a SequenceBatch, a sequence of lengths, or a row count.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    count = batch if isinstance(batch, int) else len(batch)
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def length_sorted_micro_batches(batch: Any, size: int) -> list[list[int]]:
    """Micro-batches of ``size`` rows of similar length (longest first), for scoring passes,
    whose results go back by row index: each is padded only to its own longest row."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    lengths = sequence_lengths(batch)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [sorted(order[start : start + size]) for start in range(0, len(order), size)]


def karmarkar_karp(lengths: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices of ``lengths`` into ``k`` partitions with balanced sums.

    With ``equal_size`` the partitions' sizes differ by at most one (exactly equal when
    ``len(lengths)`` is a multiple of ``k``). Partitions may be empty when there are fewer items
    than ``k``. Deterministic: ties break on index.
    """
    if k < 1:
        raise ValueError(f"number of partitions must be >= 1, got {k}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    # A state is k partitions, each (sum, indices), kept sorted by sum descending.
    if equal_size:
        groups = [order[i : i + k] for i in range(0, len(order), k)]
    else:
        groups = [[i] for i in order]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie, group in enumerate(groups):
        parts = [(lengths[i], [i]) for i in group] + [(0, []) for _ in range(k - len(group))]
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tie, parts))
    tie = len(groups)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Largest sums of one state meet the smallest of the other.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    if not heap:
        return [[] for _ in range(k)]
    partitions = [sorted(indices) for _, indices in heap[0][2]]
    # Stable, readable order: partitions by their first index (empty ones last).
    partitions.sort(key=lambda p: p[0] if p else math.inf)
    return partitions


def token_budget_micro_batches(
    batch: Any, max_tokens: int, min_micro_batches: int = 1
) -> list[list[int]]:
    """Micro-batches of rows of similar length whose padded size (rows x the longest row, what
    a forward pass computes and keeps) stays under ``max_tokens``, as few as the budget allows
    (at least ``min_micro_batches``, e.g. the count another data-parallel rank needs).

    Rows sorted by length are cut into runs: the fewest micro-batches, and among those the
    least padding (an exact dynamic program over the cuts), so a long response does not pad
    short ones up to its length (with long-tailed lengths, balancing token sums instead put one
    long row in every micro-batch and computed 2-3x the tokens). A sequence longer than the
    budget gets a micro-batch of its own. When there are fewer rows than ``min_micro_batches``
    the result has fewer micro-batches: the caller pads with empty (zero-weight) ones.
    ``batch`` is a SequenceBatch or a sequence of lengths.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = sequence_lengths(batch)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups = [order[a:b] for a, b in _cheapest_cuts([lengths[i] for i in order], max_tokens)]
    while len(groups) < min(min_micro_batches, len(lengths)):
        # Halve the costliest micro-batch that has more than one row.
        j = max(
            (g for g in range(len(groups)) if len(groups[g]) > 1),
            key=lambda g: len(groups[g]) * lengths[groups[g][0]],
        )
        group = groups.pop(j)
        groups[j:j] = [group[: len(group) // 2], group[len(group) // 2 :]]
    return sorted((sorted(g) for g in groups), key=lambda p: p[0])


def _cheapest_cuts(widths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of ``widths`` (longest first; a run is padded to its first) under
    ``max_tokens`` each (a single row may exceed it): fewest runs, then least padding."""
    inf = (math.inf, math.inf)
    best: list[tuple[float, float]] = [(0, 0)] + [inf] * len(widths)
    cut = [0] * (len(widths) + 1)
    filled = 0  # tokens of widths[:end], for each run's padding
    prefix = [0]
    for w in widths:
        filled += w
        prefix.append(filled)
    for end in range(1, len(widths) + 1):
        for start in range(end - 1, -1, -1):
            rows = end - start
            if rows > 1 and rows * widths[start] > max_tokens:
                break  # longer runs start at wider rows: over the budget too
            count, padding = best[start]
            option = (count + 1, padding + rows * widths[start] - (prefix[end] - prefix[start]))
            if option < best[end]:
                best[end], cut[end] = option, start
    runs = []
    end = len(widths)
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


def balance_across_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Assign sequences to ``num_ranks`` data-parallel ranks: equal counts (within one), balanced
    token sums. Returns one index list per rank; concatenating them in rank order gives a
    permutation the driver can apply before an equal contiguous split."""
    return karmarkar_karp([int(n) for n in lengths], num_ranks, equal_size=True)
