"""Where each step's batch of scored samples comes from: produced when the step asks for it
(synchronous), or by a producer thread that runs ahead of training by at most
``algorithm.max_staleness`` policy versions (asynchronous, one-step off-policy and beyond).

A *policy version* counts the updates that reached the rollout engine: version ``v`` is the
policy after ``v`` updates. The trainer updates with the batch of step ``s`` while at version
``s - 1``, so a batch sampled by version ``v`` is ``s - 1 - v`` versions stale. The producer
may start the batch of step ``j`` only while the engine's version ``v`` keeps ``j - 1 - v <=
max_staleness``; otherwise it waits for the next weight sync. Weight syncs take the engine
between two generations (the engine lock), never during one. With partial rollouts
(``partial=True``) the producer takes the engine for one segment of a generation at a time
(:meth:`AsyncBatches.turn`) and lets a waiting weight sync go first, so a generation longer
than a segment goes on with the new weights (see :mod:`posttrain.rollout.partial`).

The data position is exact across resumes: each batch carries the prompt sampler's state right
after its prompts were drawn, and a checkpoint saves the state of the last batch *trained on*;
batches produced ahead are dropped and drawn again by the resumed run.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from posttrain.rollout.groups import ScoredGroups


@attrs.define
class ProducedBatch:
    index: int  # the step it is for
    scored: ScoredGroups
    sampling_metrics: dict[str, float]
    sampler_state: dict[str, int]  # the prompt sampler right after this batch's prompts
    policy_version: int  # the policy that sampled every sample of it
    # Seconds the producer spent on it, per phase (asynchronous only; the synchronous loop's
    # phases are timed by the loop's own timer).
    timings: dict[str, float] = attrs.field(factory=dict)
    # The producer's ranks' ``rank_time``/``memory`` figures (asynchronous only: the loop's
    # thread does not call the producer's processes, see ``AsyncBatches``).
    rank_stats: dict[str, float] = attrs.field(factory=dict)


# produce(index, timer) -> (scored groups, sampling metrics, sampler state after its prompts);
# with partial rollouts also ``engine_turn=``, a context manager per segment (AsyncBatches.turn).
Produce = Callable[..., tuple[ScoredGroups, dict[str, float], dict[str, int]]]


class _Stopped(Exception):
    """The run closed the batch source while the producer waited for a turn."""


class SynchronousBatches:
    """The batch of a step is produced when the step asks for it, by the current policy."""

    def __init__(self, produce: Produce, version: int):
        self.produce = produce
        self.version = version

    def next(self, index: int, timer) -> ProducedBatch:
        scored, sampling, sampler_state = self.produce(index, timer)
        return ProducedBatch(index, scored, sampling, sampler_state, self.version)

    def sync_weights(self, sync: Callable[[], dict], version: int) -> dict:
        result = sync()
        self.version = version
        return result

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
    each as soon as the staleness bound allows; ``next`` hands them over in order."""

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
        self.version = version  # the policy the rollout engine holds
        self._engine = threading.Lock()  # held for a generation or a weight sync
        self._version_changed = threading.Condition()
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._idle_s = 0.0  # producer time waiting (staleness bound, engine) since the last step
        self._idle_last = 0.0  # ... up to the step being trained on
        self._thread = threading.Thread(
            target=self._run, args=(first, last), name="posttrain-rollout-producer", daemon=True
        )
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        try:
            for index in range(first, last + 1):
                wait_start = time.perf_counter()
                with self._version_changed:
                    while index - 1 - self.version > self.max_staleness:
                        if self._stop.is_set():
                            return
                        self._version_changed.wait(0.1)
                if self.partial:
                    with self._version_changed:
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
                        with self._version_changed:
                            self._idle_s += time.perf_counter() - wait_start
                            version = self.version
                        timer = self.make_timer()
                        scored, sampling, sampler_state = self.produce(index, timer)
                        stats = self.rank_stats()
                timings = {f"async/{k.removeprefix('time/')}_s": v for k, v in timer.pop().items()}
                self._ready.put(
                    ProducedBatch(index, scored, sampling, sampler_state, version, timings, stats)
                )
        except _Stopped:
            return
        except BaseException as exc:  # handed to the loop's thread by next()
            self._ready.put(exc)

    @contextlib.contextmanager
    def turn(self) -> Iterator[int]:
        """The engine for one segment of a partial rollout, after any weight sync waiting for
        it (a lock is not fair: without the wait the producer could take it again at once);
        yields the policy version the engine holds meanwhile."""
        wait_start = time.perf_counter()
        with self._version_changed:
            while self._syncs_waiting and not self._stop.is_set():
                self._version_changed.wait(0.1)
        with self._engine:
            with self._version_changed:
                if self._stop.is_set():
                    raise _Stopped
                self._idle_s += time.perf_counter() - wait_start
                version = self.version
            yield version

    def next(self, index: int, timer) -> ProducedBatch:
        """The batch of step ``index``; waiting for it is the trainer's idle time, timed as the
        ``wait_rollout`` phase."""
        with timer.phase("wait_rollout"):
            item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        if item.index != index:
            raise RuntimeError(f"rollout producer handed over step {item.index}, not {index}")
        with self._version_changed:
            self._idle_last, self._idle_s = self._idle_s, 0.0
        return item

    def engine(self) -> contextlib.AbstractContextManager:
        """The rollout engine for the loop's own use (the evaluation phase), between two of the
        producer's generations; the producer waits meanwhile. Only the loop syncs weights, so
        after a step's sync the engine holds the trainer's policy until the next step's."""
        return self._engine

    def idle(self, metrics: dict[str, float]) -> dict[str, float]:
        """Seconds of the step each side waited: the trainer for the batch, the producer for
        the staleness bound or the engine (a weight sync) since the previous step."""
        return {"idle/trainer_s": metrics["time/wait_rollout"], "idle/rollout_s": self._idle_last}

    def sync_weights(self, sync: Callable[[], dict], version: int) -> dict:
        """Run ``sync`` between two generations (partial rollouts: two segments), then let the
        producer use ``version``."""
        with self._version_changed:
            self._syncs_waiting += 1
        try:
            with self._engine:
                result = sync()
                with self._version_changed:
                    self.version = version
        finally:
            with self._version_changed:
                self._syncs_waiting -= 1
                self._version_changed.notify_all()
        return result

    def close(self) -> None:
        """Stop producing (the run ended or failed); a generation under way is left to finish
        or to fail when the launcher stops its processes."""
        self._stop.set()
        with self._version_changed:
            self._version_changed.notify_all()
        self._thread.join(timeout=5)
