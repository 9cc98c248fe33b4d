"""Environment instances in worker processes the driver owns (``environment.isolation:
process``): a call that overruns is killed, not abandoned.

Each episode's environment is built in one worker (its home), which keeps it between turns and
answers its calls one at a time, in the order sent. The driver keeps one call in flight per
worker and gives it ``step_timeout_s`` from when it was sent, so a round's calls take up to
(calls per worker) x ``step_timeout_s`` in all. A call that overruns, or a worker that dies (a
segfault, ``os._exit``, the OOM killer), costs that worker: its whole session (the processes
its environments started too) is killed with SIGKILL and a fresh worker takes its place. The
other episodes whose environments lived in it end too, since their state is gone, and say why.

Workers are started with 'spawn' (a pool of :class:`multiprocessing.Process` rather than
``ProcessPoolExecutor``, which cannot kill a hung task): a fork of the driver would copy its
threads' locks and its engines' state.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any

import attrs

from posttrain.errors import UserError
from posttrain.rollout.environments.calls import Outcome
from posttrain.rollout.environments.worker import FORGET, STOP, serve

# Spawning a worker imports Python, posttrain and the factory's module (torch can take a while).
START_TIMEOUT_S = 120.0
# How long a worker asked to stop may take before it is killed.
STOP_GRACE_S = 2.0


@attrs.define
class _Worker:
    process: Any  # multiprocessing's Process
    conn: Any  # the driver's end of its pipe


@attrs.define
class _Call:
    episode_id: str
    method: str  # "create", "reset", "step"
    argument: Any


class ProcessInstances:
    """The environments of one run, in ``processes`` workers."""

    def __init__(self, name: str, factory: Any, config: Any, processes: int):
        try:
            pickle.dumps((factory, config))
        except Exception as exc:
            raise UserError(
                f"environment '{name}': isolation: process sends the factory and "
                f"environment.kwargs to worker processes, and they cannot be pickled ({exc}); "
                "declare the factory as a module-level class or function (or 'module:attr'), "
                "or set environment.isolation: thread"
            ) from None
        self.name = name
        self.factory = factory
        self.config = config
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker | None] = [None] * processes
        self.home: dict[str, int] = {}  # episode id -> the worker slot holding its environment
        self.held: dict[int, set[str]] = {}  # slot -> the episodes whose environment it built
        self.lost: dict[str, str] = {}  # episode id -> why its environment is gone
        self._turn = 0  # round robin over the slots

    # -- what the runner asks -------------------------------------------------------------------

    def create(self, ids: list[str], timeout_s: float) -> list[Outcome]:
        for episode_id in ids:
            self.home[episode_id] = self._turn % len(self.workers)
            self._turn += 1
            self.lost.pop(episode_id, None)
        return self._run([_Call(i, "create", None) for i in ids], timeout_s)

    def call(self, method: str, calls: list[tuple[str, Any]], timeout_s: float) -> list[Outcome]:
        return self._run([_Call(i, method, argument) for i, argument in calls], timeout_s)

    def forget_all(self) -> None:
        """The step's episodes are over: their environments go."""
        for worker in self.workers:
            if worker is not None:
                with contextlib.suppress(OSError):  # dead: replaced when next needed
                    worker.conn.send(FORGET)
        self.home.clear()
        self.held.clear()
        self.lost.clear()

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.process.pid for w in self.workers if w is not None]

    def close(self) -> None:
        """Stop every worker (a busy one is killed after ``STOP_GRACE_S``) and what its
        environments started."""
        for worker in self.workers:
            if worker is not None:
                with contextlib.suppress(OSError):  # dead already: killed below all the same
                    worker.conn.send(STOP)
        deadline = time.monotonic() + STOP_GRACE_S
        for slot, worker in enumerate(self.workers):
            if worker is not None:
                worker.process.join(max(0.0, deadline - time.monotonic()))
                self._kill(slot)

    # -- the calls of one phase ----------------------------------------------------------------

    def _run(self, calls: list[_Call], timeout_s: float) -> list[Outcome]:
        """Every call's outcome, in order; each worker takes its calls one at a time."""
        results: list[Outcome | None] = [None] * len(calls)
        queues: dict[int, deque[int]] = {}
        for index, call in enumerate(calls):
            queues.setdefault(self.home[call.episode_id], deque()).append(index)
        self._start([slot for slot in queues if self.workers[slot] is None])
        flight: dict[int, tuple[int, float]] = {}  # slot -> (call index, deadline)

        def send_next(slot: int) -> None:
            queue = queues[slot]
            while queue:
                index = queue.popleft()
                call = calls[index]
                why = self.lost.get(call.episode_id) if call.method != "create" else None
                if why is not None:
                    results[index] = Outcome(error=why, died=True)
                    continue
                if self.workers[slot] is None:
                    self._start([slot])
                try:
                    self._worker(slot).conn.send(
                        (index, call.episode_id, call.method, call.argument)
                    )
                except OSError:  # it died between calls
                    results[index] = self._died(slot, call)
                    continue
                flight[slot] = (index, time.monotonic() + timeout_s)
                return

        for slot in queues:
            send_next(slot)
        while flight:
            soonest = min(deadline for _, deadline in flight.values())
            conns = {self._worker(slot).conn: slot for slot in flight}
            ready = wait(list(conns), timeout=max(0.0, soonest - time.monotonic()))
            for slot in [conns[conn] for conn in ready]:
                index, _ = flight.pop(slot)
                call = calls[index]
                try:
                    outcome: Outcome = self._worker(slot).conn.recv()[1]
                except (EOFError, OSError):  # the worker died in the call
                    outcome = self._died(slot, call)
                else:
                    if call.method == "create" and outcome.error is None:
                        self.held.setdefault(slot, set()).add(call.episode_id)
                results[index] = outcome
                send_next(slot)
            now = time.monotonic()
            for slot, (index, deadline) in list(flight.items()):
                # An answer that came in meanwhile (a replacement worker starting) still counts.
                if deadline <= now and not self._worker(slot).conn.poll(0):
                    del flight[slot]
                    results[index] = Outcome(timed_out=True)
                    self._lose(slot, calls[index], None)
                    send_next(slot)
        return [r or Outcome(error="the call was never made", died=True) for r in results]

    def _lose(self, slot: int, call: _Call, death: str | None) -> None:
        """Kill the worker of ``slot`` (``death``: how it died; None: ``call`` overran); the
        environments it held are lost."""
        self._kill(slot)
        what = "the constructor" if call.method == "create" else f"{call.method}()"
        if death is None:
            cause = f"was killed when {what} of {call.episode_id} overran"
        else:
            cause = f"died in {what} of {call.episode_id} ({death})"
        for episode_id in self.held.pop(slot, set()) | {call.episode_id}:
            self.lost[episode_id] = f"its environment was lost: its worker process {cause}"

    def _died(self, slot: int, call: _Call) -> Outcome:
        """``call``'s outcome when its worker died in it (or before it was sent)."""
        death = self._death(self._worker(slot))
        self._lose(slot, call, death)
        return Outcome(error=f"the worker process died ({death})", died=True)

    def _worker(self, slot: int) -> _Worker:
        worker = self.workers[slot]
        if worker is None:
            raise RuntimeError(f"environment worker {slot} is not running")  # a bug of this pool
        return worker

    @staticmethod
    def _death(worker: _Worker) -> str:
        """How ``worker`` ended: its exit code or signal."""
        worker.process.join(1.0)
        code = worker.process.exitcode
        if code is None:
            return "its pipe broke"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    # -- the workers ---------------------------------------------------------------------------

    def _start(self, slots: list[int]) -> None:
        """Start a worker in each of ``slots`` and wait until each is ready."""
        started = []
        for slot in slots:
            parent, child = self.context.Pipe()
            process = self.context.Process(
                target=serve,
                args=(child, self.factory, self.config, os.getpid()),
                name=f"posttrain-env-{slot}",
                daemon=True,
            )
            process.start()
            child.close()
            self.workers[slot] = _Worker(process, parent)
            started.append(slot)
        for slot in started:
            conn = self._worker(slot).conn
            try:
                ready = (
                    conn.recv()
                    if conn.poll(START_TIMEOUT_S)
                    else ("failed", f"no answer within {START_TIMEOUT_S:g}s")
                )
            except (EOFError, OSError):
                ready = ("failed", self._death(self._worker(slot)))
            if ready[0] != "ready":
                self._kill(slot)
                raise UserError(
                    f"environment '{self.name}': a worker process (isolation: process) did not "
                    f"start: {ready[1]} (its error, if any, is printed above); a script that "
                    "starts posttrain itself needs the `if __name__ == '__main__':` guard"
                )

    def _kill(self, slot: int) -> None:
        """SIGKILL the worker of ``slot`` and its session (what its environments started)."""
        worker, self.workers[slot] = self.workers[slot], None
        if worker is None:
            return
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or not yet in a session of its own
            worker.process.kill()
        worker.process.join(STOP_GRACE_S)
        worker.conn.close()
