"""A weight sync that proves itself: the trainer's side puts the byte sums of each bucket's
tensors on the bucket as it leaves the engine (``WeightBucket.digests``, computed on the device:
milliseconds for gigabytes), and the rollout side sums what it received before its engine loads
it. A difference, or a bucket whose names the sender did not sum, stops the run at that sync,
naming the tensors: corrupted or truncated weights never reach a rollout silently.

``trainer.weight_sync_verify``: ``every`` sums every bucket of every sync; ``first`` (the default)
every bucket of the first sync and one bucket of each later sync, in turn; ``off`` none. The
transports carry the sums: in process and through shared memory on the bucket itself, over a
broadcast in its metadata. An engine that receives broadcasts in processes of its own
(``posttrain_weight_receiver``) is not checked: its rank never holds the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.errors import UserError
from posttrain.weight_sync.manifest import name_problems

if TYPE_CHECKING:
    import torch

    from posttrain.protocol import WeightBucket


@attrs.define
class SyncLink:
    """A rank's place in a broadcast sync group (posttrain.weight_sync.rank_side)."""

    store: Any = None  # the group's store: each round's bucket metadata and byte sums
    group: Any = None  # the process group, on the ranks that broadcast or receive themselves
    receiver: Any = None  # (an engine's receiver, the group's name): it takes the broadcasts
    rounds: int = 0  # broadcast rounds begun
    last_count: int = -1  # buckets the sending rank published in the previous round
    pending: WeightBucket | None = None  # the exported bucket its broadcast waits to send


@attrs.define
class SyncState:
    """What a rank keeps between two syncs (``WorkerContext.sync``)."""

    link: SyncLink | None = None  # set while the rank is in a broadcast group
    rounds: int = 0  # syncs begun on this rank
    # Which buckets of this sync to sum: "all", a bucket index, or None.
    plan: str | int | None = None
    count: int = 1  # buckets of the previous sync (which one to sample next)
    verified: int = 0  # buckets checked on the receiving side, this sync


class WeightSyncMismatch(UserError):
    """What the rollout side received is not what the trainer sent (a faulty link or transport,
    engines whose versions disagree): reported as a user error, exit 2, with no traceback."""


def byte_sums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Per tensor, the sum of its 32-bit words (of its bytes where its size is not a multiple
    of 4), in int64, on its device; one transfer to the host for all of them. Summing words
    reads a quarter of the elements bytes would (4.4x faster on a CPU), and a changed byte
    still changes its word."""
    import torch

    sums = [_word_sum(t.detach().contiguous().reshape(-1).view(torch.uint8)) for t in tensors]
    if not sums:
        return []
    return [int(s) for s in torch.stack([s.to(sums[0].device) for s in sums]).tolist()]


def _word_sum(flat: torch.Tensor) -> torch.Tensor:
    import torch

    if flat.numel() % 4:
        return flat.sum(dtype=torch.int64)
    # Which sum depends on the size alone, never on where the tensor sits: a received tensor at
    # an odd offset of its bucket's buffer is copied to an aligned one first.
    if flat.storage_offset() % 4:
        flat = flat.clone()
    return flat.view(torch.int32).sum(dtype=torch.int64)


def begin_sync(state: SyncState, verify: str) -> None:
    """On a sending rank, before its export: which buckets this sync sums."""
    state.rounds += 1
    if verify == "every" or (verify == "first" and state.rounds == 1):
        state.plan = "all"
    elif verify == "first":
        state.plan = (state.rounds - 2) % max(1, state.count)
    else:
        state.plan = None


def with_digests(state: SyncState, buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
    """The export's buckets, those the plan names carrying their byte sums."""
    plan, state.plan = state.plan, None
    index = 0
    for bucket in buckets:
        if bucket:
            if plan == "all" or plan == index:
                bucket.digests = byte_sums(t for _, t in bucket.tensors)
            index += 1
        yield bucket
    state.count = index


def checked(
    state: SyncState,
    buckets: Iterable[WeightBucket],
    where: str,
    engine_shapes: Callable[[], dict[str, tuple[int, ...]] | None] | None = None,
) -> Iterator[WeightBucket]:
    """The received buckets, each that carries sums checked before it is handed on: its bytes,
    and its names and shapes against ``engine_shapes()`` (what the receiving engine takes,
    ``posttrain_weight_shapes``; :mod:`posttrain.weight_sync.manifest`) where it says."""
    state.verified = 0
    for bucket in buckets:
        if bucket and bucket.digests is not None:
            expected = engine_shapes() if engine_shapes is not None else None
            if expected is not None:
                check_names(bucket, where, expected)
            check(bucket, where)
            state.verified += 1
        yield bucket


def _listed(items: list[str], most: int = 8) -> str:
    """``items`` joined, the first ``most`` of them, with how many more."""
    more = f"; and {len(items) - most} more" if len(items) > most else ""
    return "; ".join(items[:most]) + more


def check_names(bucket: WeightBucket, where: str, expected: dict[str, tuple[int, ...]]) -> None:
    """Each of the bucket's tensors is one the engine takes, with the shape it takes."""
    problems = name_problems(((n, tuple(t.shape)) for n, t in bucket.tensors), expected)
    if problems:
        raise WeightSyncMismatch(
            f"weight sync into {where}: the trainer's weights do not match the rollout engine's: "
            f"{_listed(problems)}. A trainer and a rollout engine of different versions may name "
            "or shape a parameter differently: the run stops here rather than roll out with "
            "weights nobody trained."
        )


def check(bucket: WeightBucket, where: str) -> None:
    sent_sums = bucket.digests
    assert sent_sums is not None  # checked() checks only the buckets that carry sums
    names = [name for name, _ in bucket.tensors]
    if len(sent_sums) != len(names):
        raise WeightSyncMismatch(
            f"weight sync into {where}: a bucket of {len(names)} tensors came with the sums of "
            f"{len(sent_sums)}: its tensors were added or dropped on the way ({names[:5]})"
        )
    got = byte_sums(t for _, t in bucket.tensors)
    differ = [
        f"{name} (sent {sent}, received {recv})"
        for name, sent, recv in zip(names, sent_sums, got)
        if sent != recv
    ]
    if differ:
        raise WeightSyncMismatch(
            f"weight sync into {where}: {len(differ)} of the bucket's {len(names)} tensors "
            f"differ from what the trainer sent (byte sums): {_listed(differ)}. The run stops here "
            "rather than roll out with weights nobody trained."
        )
