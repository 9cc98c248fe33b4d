"""posttrain: reinforcement-learning post-training of language models with pluggable backends.

Cheap to import: no torch, no engine. Plugins use :data:`hookimpl` to implement the hooks of
:mod:`posttrain.hookspecs`.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("posttrain")

__all__ = ["__version__", "hookimpl"]
