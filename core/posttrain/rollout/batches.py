"""Where each step's batch of scored samples comes from: produced when the step asks for it
(synchronous), or by a producer thread that runs ahead of training by ``algorithm.max_staleness``
policy versions (asynchronous, one-step off-policy and beyond).

A *policy version* counts the updates that reached the rollout engine: version ``v`` is the
policy after ``v`` updates. The trainer updates with the batch of step ``s`` while at version
``s - 1``, so a batch sampled by version ``v`` is ``s - 1 - v`` versions stale.

The asynchronous schedule is fixed, so that two runs, and a run and its resume, are the same
run whatever the timing: the batch of step ``j`` is sampled by the policy synced after step
``j - 1 - max_staleness`` (version 0 for the first ``max_staleness + 1`` steps), exactly
``max_staleness`` versions stale. The producer starts it once that sync is done; the sync after
step ``v`` waits until the batch of step ``v + max_staleness``, the last one the previous policy
samples, is made. With ``max_staleness: 1`` the trainer waits for nothing it would not wait for
anyway (the next step's batch). Weight syncs take the engine between two generations (the engine
lock), never during one.

With partial rollouts (``partial=True``) the producer takes the engine for one segment of a
generation at a time (:meth:`AsyncBatches.turn`) and a waiting weight sync goes first, so a
generation longer than a segment goes on with the new weights (see
:mod:`posttrain.rollout.partial`). Which segment a sync lands between depends on timing: such a
run keeps the staleness bound (at most ``max_staleness`` versions) but is not reproducible token
for token.

Nothing is lost across a resume: a checkpoint holds the batches produced ahead of the step it
saves (:meth:`AsyncBatches.ahead`, written by :mod:`posttrain.rollout.ahead`), and the resumed
run trains on them before its producer draws more prompts. Each batch carries the prompt
sampler's state right after its prompts were drawn, so the producer goes on where the last of
them left off.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.rollout.groups import ScoredGroups

if TYPE_CHECKING:
    from posttrain.trainer.phase_timer import PhaseTimer


@attrs.define
class ProducedBatch:
    index: int  # the step it is for
    scored: ScoredGroups
    sampling_metrics: dict[str, float]
    sampler_state: dict[str, int]  # the prompt sampler right after this batch's prompts
    policy_version: int  # the policy that sampled every sample of it (partial: its first)
    # Seconds the producer spent on it, per phase (asynchronous only; the synchronous loop's
    # phases are timed by the loop's own timer).
    timings: dict[str, float] = attrs.field(factory=dict)
    # The producer's ranks' ``rank_time``/``memory`` figures (asynchronous only: the loop's
    # thread does not call the producer's processes, see ``AsyncBatches``).
    rank_stats: dict[str, float] = attrs.field(factory=dict)


# produce(index, timer) -> (scored groups, sampling metrics, sampler state after its prompts);
# with partial rollouts also ``engine_turn=``, a context manager per segment (AsyncBatches.turn).
Produce = Callable[..., tuple[ScoredGroups, dict[str, float], dict[str, int]]]
# A weight sync: returns what it moved ({"bytes": ...}). None: the step changed no weights (a
# critic's warm-up), the schedule moves on all the same.
Sync = Callable[[], dict[str, Any]] | None


class _Stopped(Exception):
    """The run closed the batch source while the producer waited for a turn."""


class SynchronousBatches:
    """The batch of a step is produced when the step asks for it, by the current policy;
    ``ahead``: batches a checkpoint of an asynchronous run kept, handed over first."""

    def __init__(self, produce: Produce, version: int, ahead: Sequence[ProducedBatch] = ()):
        self.produce = produce
        self.version = version
        self._ahead = collections.deque(ahead)

    def next(self, index: int, timer: PhaseTimer) -> ProducedBatch:
        if self._ahead:
            return _expected(self._ahead.popleft(), index)
        scored, sampling, sampler_state = self.produce(index, timer)
        return ProducedBatch(index, scored, sampling, sampler_state, self.version)

    def sync_weights(self, sync: Sync, version: int) -> dict[str, Any]:
        if sync is None:
            return {}
        result = sync()
        self.version = version
        return result

    def ahead(self) -> list[ProducedBatch]:
        """Batches made and not trained on yet: only those a resume handed over."""
        return list(self._ahead)

    @staticmethod
    def engine() -> contextlib.AbstractContextManager:
        """The rollout engine for the loop's own use (the evaluation phase): nothing else uses
        it between the loop's calls."""
        return contextlib.nullcontext()

    @staticmethod
    def idle(metrics: dict[str, float]) -> dict[str, float]:
        """Seconds of the step each side waited: the trainer while the batch was rolled out and
        scored, the rollout engine during everything else."""
        producing = metrics.get("time/rollout", 0.0) + metrics.get("time/reward", 0.0)
        return {"idle/trainer_s": producing, "idle/rollout_s": metrics["time/step"] - producing}

    def close(self) -> None:
        """Nothing runs in the background."""


class AsyncBatches:
    """A producer thread rolls out and scores the batches of steps ``first .. last`` in order,
    on the schedule above; ``next`` hands them over in order. ``ahead``: the batches of the
    steps from ``first`` on that a checkpoint kept (the producer starts after them)."""

    def __init__(
        self,
        produce: Produce,
        version: int,
        max_staleness: int,
        first: int,
        last: int,
        make_timer: Callable[[], Any],
        rank_stats: Callable[[], dict[str, float]] = dict,
        partial: bool = False,
        ahead: Sequence[ProducedBatch] = (),
    ):
        self.produce = produce
        # Partial rollouts: produce takes the engine per segment (engine_turn), not per batch.
        self.partial = partial
        self._syncs_waiting = 0  # weight syncs waiting for the engine: a turn lets them first
        # Asked between two generations, from the producer's thread: the figures of the ranks
        # it drives (a call from the loop's thread would wait behind a generation under way).
        self.rank_stats = rank_stats
        self.max_staleness = max_staleness
        self.make_timer = make_timer
        self.last = last
        self.version = version  # the policy the rollout engine holds
        self._synced = first - 1  # the last step whose weight sync is done (or skipped)
        self._engine = threading.Lock()  # held for a generation or a weight sync
        self._changed = threading.Condition()  # the fields below, the version, the queue
        self._ready: collections.deque = collections.deque(ahead)  # batches, or the failure
        self._made = first - 1 + len(ahead)  # the last step whose batch is made
        self._stop = threading.Event()
        self._idle_s = 0.0  # producer time waiting (staleness bound, engine) since the last step
        self._idle_last = 0.0  # ... up to the step being trained on
        self._thread = threading.Thread(
            target=self._run,
            args=(self._made + 1, last),
            name="posttrain-rollout-producer",
            daemon=True,
        )
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        try:
            for index in range(first, last + 1):
                wait_start = time.perf_counter()
                with self._changed:
                    while index - 1 - self._synced > self.max_staleness:
                        if self._stop.is_set():
                            return
                        self._changed.wait(0.1)
                if self.partial:
                    with self._changed:
                        self._idle_s += time.perf_counter() - wait_start
                        version = self.version  # its first segment's: the batch's oldest
                    timer = self.make_timer()
                    scored, sampling, sampler_state = self.produce(
                        index, timer, engine_turn=self.turn
                    )
                    with self._engine:  # the ranks answer between two segments
                        stats = self.rank_stats()
                else:
                    with self._engine:
                        if self._stop.is_set():
                            return
                        with self._changed:
                            self._idle_s += time.perf_counter() - wait_start
                            version = self.version
                        timer = self.make_timer()
                        scored, sampling, sampler_state = self.produce(index, timer)
                        stats = self.rank_stats()
                timings = {f"async/{k.removeprefix('time/')}_s": v for k, v in timer.pop().items()}
                batch = ProducedBatch(
                    index, scored, sampling, sampler_state, version, timings, stats
                )
                with self._changed:
                    self._ready.append(batch)
                    self._made = index
                    self._changed.notify_all()
        except _Stopped:
            return
        except BaseException as exc:  # handed to the loop's thread by next()
            with self._changed:
                self._ready.append(exc)
                self._changed.notify_all()

    @contextlib.contextmanager
    def turn(self) -> Iterator[int]:
        """The engine for one segment of a partial rollout, after any weight sync waiting for
        it (a lock is not fair: without the wait the producer could take it again at once);
        yields the policy version the engine holds meanwhile."""
        wait_start = time.perf_counter()
        with self._changed:
            while self._syncs_waiting and not self._stop.is_set():
                self._changed.wait(0.1)
        with self._engine:
            with self._changed:
                if self._stop.is_set():
                    raise _Stopped
                self._idle_s += time.perf_counter() - wait_start
                version = self.version
            yield version

    def next(self, index: int, timer: PhaseTimer) -> ProducedBatch:
        """The batch of step ``index``; waiting for it is the trainer's idle time, timed as the
        ``wait_rollout`` phase."""
        with timer.phase("wait_rollout"), self._changed:
            while not self._ready:
                self._changed.wait()
            item = self._ready.popleft()
            self._idle_last, self._idle_s = self._idle_s, 0.0
        if isinstance(item, BaseException):
            raise item
        return _expected(item, index)

    def ahead(self) -> list[ProducedBatch]:
        """The batches made and not trained on yet (what a checkpoint keeps). After a step's
        weight sync these include every batch the previous policies sample."""
        with self._changed:
            return [b for b in self._ready if isinstance(b, ProducedBatch)]

    def engine(self) -> contextlib.AbstractContextManager:
        """The rollout engine for the loop's own use (the evaluation phase), between two of the
        producer's generations; the producer waits meanwhile. Only the loop syncs weights, so
        after a step's sync the engine holds the trainer's policy until the next step's."""
        return self._engine

    def idle(self, metrics: dict[str, float]) -> dict[str, float]:
        """Seconds of the step each side waited: the trainer for the batch, the producer for
        the staleness bound or the engine (a weight sync) since the previous step."""
        return {"idle/trainer_s": metrics["time/wait_rollout"], "idle/rollout_s": self._idle_last}

    def sync_weights(self, sync: Sync, version: int) -> dict[str, Any]:
        """The weight sync after step ``version``: once the batches the previous policy samples
        are made (not with partial rollouts: those take the sync between two segments), run
        ``sync`` between two generations, then let the producer go on with ``version``."""
        if not self.partial:
            self._wait_made(min(version + self.max_staleness, self.last))
        with self._changed:
            self._syncs_waiting += 1
        try:
            with self._engine:
                result = sync() if sync is not None else {}
                with self._changed:
                    if sync is not None:
                        self.version = version
                    self._synced = version
        finally:
            with self._changed:
                self._syncs_waiting -= 1
                self._changed.notify_all()
        return result

    def _wait_made(self, index: int) -> None:
        """Until the batch of step ``index`` is made (or the producer stopped: the loop's next
        ``next`` raises its failure)."""
        with self._changed:
            while self._made < index and self._thread.is_alive():
                if self._ready and isinstance(self._ready[-1], BaseException):
                    return
                self._changed.wait(0.1)

    def close(self) -> None:
        """Stop producing (the run ended or failed); a generation under way is left to finish
        or to fail when the launcher stops its processes."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=5)


def _expected(batch: ProducedBatch, index: int) -> ProducedBatch:
    if batch.index != index:
        raise RuntimeError(f"rollout producer handed over step {batch.index}, not {index}")
    return batch
