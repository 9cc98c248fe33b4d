"""Where a run's environment instances live, by ``environment.isolation``: in the driver, called
from threads (:class:`ThreadInstances`), or in worker processes
(:class:`~posttrain.rollout.environments.process_pool.ProcessInstances`). Both answer the
runner alike: one :class:`~posttrain.rollout.environments.calls.Outcome` per call, in order."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from posttrain.rollout.environments.calls import Outcome, call_all

if TYPE_CHECKING:
    from posttrain.config.sections import EnvironmentConfig
    from posttrain.rollout.environments.protocol import Environment


class Instances(Protocol):
    def create(self, ids: list[str], timeout_s: float) -> list[Outcome]:
        """Build one environment per episode id (the outcome's value is None)."""

    def call(self, method: str, calls: list[tuple[str, Any]], timeout_s: float) -> list[Outcome]:
        """``environment.method(argument)`` for each ``(episode id, argument)``."""

    def forget_all(self) -> None:
        """The step's episodes are over: drop their environments."""

    def close(self) -> None:
        """The run is over."""


class ThreadInstances:
    """Environments in the driver; each round's calls run side by side in daemon threads."""

    def __init__(self, factory: Callable[[Any], Environment], config: Any) -> None:
        self.factory = factory
        self.config = config
        self.environments: dict[str, Any] = {}

    def create(self, ids: list[str], timeout_s: float) -> list[Outcome]:
        outcomes = call_all([lambda: self.factory(self.config) for _ in ids], timeout_s)
        for episode_id, outcome in zip(ids, outcomes):
            if outcome.error is None and not outcome.timed_out:
                self.environments[episode_id] = outcome.value
        return [_without_value(o) for o in outcomes]

    def call(self, method: str, calls: list[tuple[str, Any]], timeout_s: float) -> list[Outcome]:
        bound = [getattr(self.environments[i], method) for i, _ in calls]
        return call_all([functools.partial(f, a) for f, (_, a) in zip(bound, calls)], timeout_s)

    def forget_all(self) -> None:
        # An abandoned call may still hold its environment; no call reaches it again.
        self.environments.clear()

    def close(self) -> None:
        self.environments.clear()


def _without_value(outcome: Outcome) -> Outcome:
    """The outcome without the environment it built (which stays in the driver)."""
    return attrs.evolve(outcome, value=None)


def make_instances(
    name: str,
    spec_factory: Callable[[Any], Environment] | str,
    factory: Callable[[Any], Environment],
    environment: EnvironmentConfig,
) -> Instances:
    """The instances ``environment.isolation`` asks for, of ``environment.kwargs`` (``name``:
    ``environment.name``; ``spec_factory``: the factory as the spec declares it, a callable or
    ``"module:attr"``; ``factory``: it loaded)."""
    if environment.isolation == "process":
        from posttrain.rollout.environments.process_pool import ProcessInstances

        return ProcessInstances(name, spec_factory, environment.kwargs, environment.processes)
    return ThreadInstances(factory, environment.kwargs)
