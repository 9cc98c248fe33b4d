"""posttrain: reinforcement-learning post-training of language models with pluggable backends.

This package is the public face for plugins, as ``pytest`` is for pytest plugins: every name
below is kept stable, documented in docs/plugin-guide.md ("The public face"), and is all a
backend, an algorithm, an environment, a reward or a metrics plugin imports from core (with
:mod:`posttrain.hookspecs`, and :mod:`posttrain.testing` in its tests). Everything else in core
may move between releases.

Importing ``posttrain`` is cheap: each name is imported when first used, and no name imports
torch or an engine until a function that needs one is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.lazy_names import lazy_names
from posttrain.markers import hookimpl
from posttrain.version import __version__

# Public name -> the module that defines it.
_PUBLIC = {
    # Declaring strategies and what they can do
    "StrategySpec": "posttrain.host.strategy",
    "Capabilities": "posttrain.host.strategy",
    "EngineHooks": "posttrain.host.engine_hooks",
    "Engine": "posttrain.host.engine_protocols",
    "TrainEngine": "posttrain.host.engine_protocols",
    "RolloutEngine": "posttrain.host.engine_protocols",
    "EnvCheck": "posttrain.host.doctor",
    "module_version": "posttrain.host.doctor",
    # One rank of a worker group
    "WorkerContext": "posttrain.launch.worker",
    "WorkerRuntime": "posttrain.launch.worker",
    # Data between the driver and the ranks
    "SamplingParams": "posttrain.protocol",
    "GenerationRequest": "posttrain.protocol",
    "RolloutSamples": "posttrain.protocol",
    "ImageInputs": "posttrain.protocol",
    "SequenceBatch": "posttrain.protocol",
    "WeightBucket": "posttrain.protocol",
    "bucketize": "posttrain.protocol",
    "stop_string_start": "posttrain.protocol",
    # Typed configs and their checks
    "ModelArgs": "posttrain.config.sections",
    "TrainingArgs": "posttrain.config.sections",
    "AlgorithmConfig": "posttrain.config.sections",
    "GeneratingArgs": "posttrain.config.sections",
    "Workflow": "posttrain.config.sections",
    "ScoringOptions": "posttrain.config.scoring_options",
    "at_least": "posttrain.config.ranges",
    "greater_than": "posttrain.config.ranges",
    "between": "posttrain.config.ranges",
    "ErrorReport": "posttrain.config.report",
    "did_you_mean": "posttrain.config.report",
    "unknown_keys": "posttrain.config.report",
    "join_path": "posttrain.config.report",
    # Errors
    "PosttrainError": "posttrain.errors",
    "UserError": "posttrain.errors",
    "PluginError": "posttrain.errors",
    "PluginWarning": "posttrain.errors",
    "CheckpointError": "posttrain.errors",
    "WorkerError": "posttrain.errors",
    # Algorithms: the registries' entries
    "Advantages": "posttrain.algorithms.registry",
    "AdvantageEstimator": "posttrain.algorithms.registry",
    "PolicyLossTerm": "posttrain.algorithms.registry",
    "AlgorithmPreset": "posttrain.algorithms.registry",
    # Environments and tools
    "Environment": "posttrain.rollout.environments.protocol",
    "EnvironmentSpec": "posttrain.rollout.environments.protocol",
    "EpisodePrompt": "posttrain.rollout.environments.protocol",
    "ModelTurn": "posttrain.rollout.environments.protocol",
    "EnvStep": "posttrain.rollout.environments.protocol",
    "Tool": "posttrain.rollout.environments.tools",
    "ToolError": "posttrain.rollout.environments.tools",
    "ToolEnvironment": "posttrain.rollout.environments.tools",
    "tool_environment_spec": "posttrain.rollout.environments.tools",
    # Weight transports
    "WeightTransport": "posttrain.weight_sync.transport",
    # Metric loggers and experiment trackers
    "LoggerSpec": "posttrain.trainer.logger_spec",
    "LoggerContext": "posttrain.trainer.logger_spec",
}

__all__ = ["__version__", "hookimpl", *_PUBLIC]


__getattr__, __dir__ = lazy_names("posttrain", _PUBLIC, globals())


if TYPE_CHECKING:  # what type checkers see of the names above (a test keeps both lists equal)
    from posttrain.algorithms.registry import (
        AdvantageEstimator,
        Advantages,
        AlgorithmPreset,
        PolicyLossTerm,
    )
    from posttrain.config.ranges import at_least, between, greater_than
    from posttrain.config.report import ErrorReport, did_you_mean, join_path, unknown_keys
    from posttrain.config.scoring_options import ScoringOptions
    from posttrain.config.sections import (
        AlgorithmConfig,
        GeneratingArgs,
        ModelArgs,
        TrainingArgs,
        Workflow,
    )
    from posttrain.errors import (
        CheckpointError,
        PluginError,
        PluginWarning,
        PosttrainError,
        UserError,
        WorkerError,
    )
    from posttrain.host.doctor import EnvCheck, module_version
    from posttrain.host.engine_hooks import EngineHooks
    from posttrain.host.engine_protocols import Engine, RolloutEngine, TrainEngine
    from posttrain.host.strategy import Capabilities, StrategySpec
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain.protocol import (
        GenerationRequest,
        ImageInputs,
        RolloutSamples,
        SamplingParams,
        SequenceBatch,
        WeightBucket,
        bucketize,
        stop_string_start,
    )
    from posttrain.rollout.environments.protocol import (
        Environment,
        EnvironmentSpec,
        EnvStep,
        EpisodePrompt,
        ModelTurn,
    )
    from posttrain.rollout.environments.tools import (
        Tool,
        ToolEnvironment,
        ToolError,
        tool_environment_spec,
    )
    from posttrain.trainer.logger_spec import LoggerContext, LoggerSpec
    from posttrain.weight_sync.transport import WeightTransport
