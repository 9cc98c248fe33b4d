"""The conformance kit: contract tests every strategy must pass.

A backend's test suite subclasses :class:`StrategyContract` and names its strategy::

    from posttrain.testing import StrategyContract

    class TestMyEngine(StrategyContract):
        strategy = "my_engine"
        strategy_config = {"some_option": 1}

The fixtures come from the pytest plugin :mod:`posttrain.testing.plugin`, registered through the
``pytest11`` entry point when posttrain is installed.
"""

from posttrain.testing.contract import StrategyContract

__all__ = ["StrategyContract"]
