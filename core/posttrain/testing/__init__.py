"""The conformance kit: contract tests every strategy must pass.

A backend's test suite subclasses :class:`StrategyContract` and names its strategy::

    from posttrain.testing import StrategyContract

    class TestMyEngine(StrategyContract):
        strategy = "my_engine"
        strategy_config = {"some_option": 1}

The fixtures come from the pytest plugin :mod:`posttrain.testing.plugin`, registered through the
``pytest11`` entry point when posttrain is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.host.plugin_host import create_plugin_host
from posttrain.rewards.functions import resolve_reward_function

if TYPE_CHECKING:
    from posttrain.testing.contract import StrategyContract

# The kit, and what a plugin's tests need of core beyond the public face: the plugin host the
# CLI builds, and reward functions resolved by name as a run resolves them.
__all__ = ["StrategyContract", "create_plugin_host", "resolve_reward_function"]


def __getattr__(name: str) -> type[StrategyContract]:
    # The contract needs pytest; the kit's other parts (posttrain.testing.faults, which a run
    # loads to rehearse faults) must not.
    if name == "StrategyContract":
        from posttrain.testing.contract import StrategyContract

        return StrategyContract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
