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
from typing import TYPE_CHECKING

from posttrain.errors import UserError
from posttrain.weight_sync.manifest import name_problems

if TYPE_CHECKING:
    import torch

    from posttrain.protocol import WeightBucket

# Where a rank keeps what it needs between two syncs (WorkerContext.state).
PLAN = "_sync_digest_plan"  # "all", a bucket index, or None: which buckets of this sync to sum
ROUND = "_sync_digest_round"
COUNT = "_sync_digest_count"  # buckets of the previous sync (which one to sample next)
VERIFIED = "_sync_verified"  # buckets checked on the receiving side, this sync


class WeightSyncMismatch(UserError):
    """What the rollout side received is not what the trainer sent (a faulty link or transport,
    engines whose versions disagree): reported as a user error, exit 2, with no traceback."""


def byte_sums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Per tensor, the sum of its bytes (int64: exact up to 3.6e16 bytes), on its device; one
    transfer to the host for all of them."""
    import torch

    sums = [
        t.detach().contiguous().reshape(-1).view(torch.uint8).sum(dtype=torch.int64)
        for t in tensors
    ]
    if not sums:
        return []
    return [int(s) for s in torch.stack([s.to(sums[0].device) for s in sums]).tolist()]


def begin_sync(state: dict, verify: str) -> None:
    """On a sending rank, before its export: which buckets this sync sums."""
    state[ROUND] = state.get(ROUND, 0) + 1
    if verify == "every" or (verify == "first" and state[ROUND] == 1):
        state[PLAN] = "all"
    elif verify == "first":
        state[PLAN] = (state[ROUND] - 2) % max(1, state.get(COUNT, 1))
    else:
        state[PLAN] = None


def with_digests(state: dict, buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
    """The export's buckets, those the plan names carrying their byte sums."""
    plan = state.pop(PLAN, None)
    index = 0
    for bucket in buckets:
        if bucket:
            if plan == "all" or plan == index:
                bucket.digests = byte_sums(t for _, t in bucket.tensors)
            index += 1
        yield bucket
    state[COUNT] = index


def checked(
    state: dict,
    buckets: Iterable[WeightBucket],
    where: str,
    engine_shapes: Callable[[], dict[str, tuple[int, ...]] | None] | None = None,
) -> Iterator[WeightBucket]:
    """The received buckets, each that carries sums checked before it is handed on: its bytes,
    and its names and shapes against ``engine_shapes()`` (what the receiving engine takes,
    ``posttrain_weight_shapes``; :mod:`posttrain.weight_sync.manifest`) where it says."""
    state[VERIFIED] = 0
    for bucket in buckets:
        if bucket and bucket.digests is not None:
            expected = engine_shapes() if engine_shapes is not None else None
            if expected is not None:
                check_names(bucket, where, expected)
            check(bucket, where)
            state[VERIFIED] += 1
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
    names = [name for name, _ in bucket.tensors]
    if len(bucket.digests) != len(names):
        raise WeightSyncMismatch(
            f"weight sync into {where}: a bucket of {len(names)} tensors came with the sums of "
            f"{len(bucket.digests)}: its tensors were added or dropped on the way ({names[:5]})"
        )
    got = byte_sums(t for _, t in bucket.tensors)
    differ = [
        f"{name} (sent {sent}, received {recv})"
        for name, sent, recv in zip(names, bucket.digests, got)
        if sent != recv
    ]
    if differ:
        raise WeightSyncMismatch(
            f"weight sync into {where}: {len(differ)} of the bucket's {len(names)} tensors "
            f"differ from what the trainer sent (byte sums): {_listed(differ)}. The run stops here "
            "rather than roll out with weights nobody trained."
        )
