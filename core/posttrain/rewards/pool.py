"""Rule-based rewards called safely: a reward that raises, hangs or returns garbage scores 0.

With ``reward.num_workers: 0`` the function runs in the driver (fast functions: exact match).
Otherwise it runs in a pool of spawned processes, each call under ``reward.timeout_s``: the
worker interrupts a call that overruns with a timer signal, and the driver gives up on the whole
pool (terminates and restarts it) when a call ignores that too (a hang in C code). Failures are
counted per step (``reward/errors``, ``reward/timeouts``) and logged with the sample's index;
they never end the run.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

if TYPE_CHECKING:
    import multiprocessing.pool
    from types import FrameType

log = logging.getLogger(__name__)

# (completion, answer, prompt) of one sample.
RewardInput = tuple[str, Any, str]


class RewardTimeout(Exception):
    pass


@attrs.define
class RewardResults:
    scores: list[float]
    errors: int = 0
    timeouts: int = 0


def _as_score(value: Any) -> float:
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward is not a finite number: {value!r}")
    return score


# -- pool side ---------------------------------------------------------------------------------

_worker_fn: Callable[..., Any] | None = None


def _init_worker(target: str) -> None:
    global _worker_fn
    module, _, name = target.partition(":")
    _worker_fn = getattr(importlib.import_module(module), name)


def _on_alarm(_signum: int, _frame: FrameType | None) -> NoReturn:
    raise RewardTimeout()


def _call_in_worker(item: RewardInput, kwargs: dict[str, Any], timeout_s: float) -> tuple[str, Any]:
    """("ok", score), ("error", message) or ("timeout", None), never an exception: a pickled
    exception from user code may not unpickle in the driver."""
    fn = _worker_fn
    assert fn is not None  # set by _init_worker, the pool's initializer
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return "ok", _as_score(fn(*item, **kwargs))
    except RewardTimeout:
        return "timeout", None
    except Exception as exc:  # user code: any failure scores 0 and is reported by the driver
        return "error", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# -- driver side -------------------------------------------------------------------------------


class RuleRewards:
    """``rewards(items) -> RewardResults`` for the workflow's rule-based function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        target: str,
        kwargs: dict[str, Any],
        num_workers: int = 0,
        timeout_s: float = 10.0,
    ):
        self.fn, self.target, self.kwargs = fn, target, dict(kwargs)
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._pool: multiprocessing.pool.Pool | None = None

    def __call__(self, items: Sequence[RewardInput]) -> RewardResults:
        if self.num_workers:
            return self._in_pool(items)
        results = RewardResults(scores=[])
        for index, item in enumerate(items):
            try:
                results.scores.append(_as_score(self.fn(*item, **self.kwargs)))
            except Exception as exc:  # user code: scores 0, counted and logged
                self._failed(results, index, f"{type(exc).__name__}: {exc}")
        return results

    def _failed(self, results: RewardResults, index: int, message: str | None) -> None:
        results.scores.append(0.0)
        if message is None:
            results.timeouts += 1
            log.warning("reward: sample %d timed out after %.1fs: scored 0", index, self.timeout_s)
        else:
            results.errors += 1
            log.warning("reward: sample %d failed (%s): scored 0", index, message)

    def _start_pool(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(self.num_workers, _init_worker, (self.target,))
        return self._pool

    def _in_pool(self, items: Sequence[RewardInput]) -> RewardResults:
        pool = self._start_pool()
        pending = [
            pool.apply_async(_call_in_worker, (item, self.kwargs, self.timeout_s)) for item in items
        ]
        # Calls queue behind each other; the backstop allows every round of calls its timeout.
        rounds = math.ceil(len(items) / self.num_workers) + 1
        backstop = self.timeout_s * rounds + 2.0
        results = RewardResults(scores=[])
        broken = False
        for index, future in enumerate(pending):
            if broken:
                self._failed(results, index, None)
                continue
            try:
                status, value = future.get(timeout=backstop)
            except multiprocessing.TimeoutError:
                # A call ignored its timer (stuck in C code): the pool cannot be trusted.
                broken = True
                self._failed(results, index, None)
                continue
            if status == "ok":
                results.scores.append(value)
            else:
                self._failed(results, index, value if status == "error" else None)
        if broken:
            self.close()
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
