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

import importlib
from typing import TYPE_CHECKING, Any

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
    "SequenceBatch": "posttrain.protocol",
    "WeightBucket": "posttrain.protocol",
    "bucketize": "posttrain.protocol",
    "stop_string_start": "posttrain.protocol",
    # A rank's share of a batch: micro-batches, training passes, scoring
    "fixed_micro_batches": "posttrain.training.micro_batching",
    "token_budget_micro_batches": "posttrain.training.micro_batching",
    "micro_batch_size": "posttrain.training.rank_batches",
    "plan_micro_batches": "posttrain.training.rank_batches",
    "accumulate_gradients": "posttrain.training.rank_batches",
    "score_logprobs": "posttrain.training.rank_batches",
    "score_values": "posttrain.training.rank_batches",
    "score_sequences": "posttrain.training.rank_batches",
    "score_rows": "posttrain.training.rank_batches",
    "logprob_forward": "posttrain.scoring.logprob_head",
    "TokenLogprobs": "posttrain.scoring.logprob_head",
    "shifted_token_logprobs": "posttrain.scoring.modeling",
    "shifted_entropy": "posttrain.scoring.modeling",
    "shifted_values": "posttrain.scoring.modeling",
    "sequence_scores": "posttrain.scoring.modeling",
    "lr_lambda": "posttrain.training.lr_schedule",
    # Models and tokenizers
    "DTYPES": "posttrain.backends.models",
    "HEAD_WEIGHT": "posttrain.backends.models",
    "torch_dtype": "posttrain.backends.models",
    "resolve_model_path": "posttrain.backends.models",
    "load_tokenizer": "posttrain.backends.models",
    "load_causal_lm": "posttrain.backends.models",
    "load_model_with_head": "posttrain.backends.models",
    "no_hf_progress_bars": "posttrain.hf_progress",
    "is_preset": "posttrain.tasks.presets",
    "PRESETS": "posttrain.tasks.presets",
    # Torch plumbing of backends
    "is_cuda": "posttrain.backends.plumbing",
    "rank_device": "posttrain.backends.plumbing",
    "is_rank0": "posttrain.backends.plumbing",
    "log_once": "posttrain.backends.plumbing",
    "export_dtype": "posttrain.backends.plumbing",
    "forward_logits": "posttrain.backends.plumbing",
    "enable_gradient_checkpointing": "posttrain.backends.plumbing",
    "MEMORY_TAGS": "posttrain.backends.plumbing",
    "memory_tags": "posttrain.backends.plumbing",
    "drain": "posttrain.backends.plumbing",
    "adamw": "posttrain.backends.plumbing",
    "rng_state": "posttrain.backends.plumbing",
    "restore_rng_state": "posttrain.backends.plumbing",
    "tensor_parallel_replicas": "posttrain.backends.plumbing",
    "leads_replica": "posttrain.backends.plumbing",
    "move_optimizer_state": "posttrain.backends.plumbing",
    "settle_cuda": "posttrain.backends.plumbing",
    "save_tokenizer_beside": "posttrain.backends.plumbing",
    "end_process_group": "posttrain.backends.plumbing",
    "backend_for": "posttrain.backends.distributed",
    "init_default_process_group": "posttrain.backends.distributed",
    "destroy_default_process_group": "posttrain.backends.distributed",
    "agree_max": "posttrain.backends.distributed",
    "collective_timeout_s": "posttrain.backends.distributed",
    # LoRA adapters of trainers (model_args.lora)
    "LORA_ADAPTER": "posttrain.backends.lora",
    "LORA_RECORD": "posttrain.backends.lora",
    "lora_args": "posttrain.backends.lora",
    "wrap_lora": "posttrain.backends.lora",
    "lora_layers": "posttrain.backends.lora",
    "lora_base_model": "posttrain.backends.lora",
    "lora_plain_name": "posttrain.backends.lora",
    "is_lora_adapter_entry": "posttrain.backends.lora",
    "lora_adapter_keys": "posttrain.backends.lora",
    "merge_lora_weight": "posttrain.backends.lora",
    "lora_record": "posttrain.backends.lora",
    "check_lora_record": "posttrain.backends.lora",
    "write_lora_adapter": "posttrain.backends.lora",
    # Exported weights and checkpoints
    "write_shards": "posttrain.backends.safetensors_shards",
    "export_streamed": "posttrain.backends.safetensors_shards",
    "unshare_storage": "posttrain.backends.tensors",
    "BackgroundSave": "posttrain.checkpoint.background",
    "HostBuffers": "posttrain.checkpoint.host_buffers",
    "write_threads": "posttrain.checkpoint.host_buffers",
    "FileDigests": "posttrain.checkpoint.digests",
    "HashingStream": "posttrain.checkpoint.digests",
    # Typed configs and their checks
    "ModelArgs": "posttrain.config.sections",
    "TrainingArgs": "posttrain.config.sections",
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
    # Memory estimates (posttrain_estimate_memory)
    "MemoryQuery": "posttrain.memory.estimate",
    "RoleMemory": "posttrain.memory.estimate",
    "Workload": "posttrain.memory.estimate",
    "ModelGeometry": "posttrain.memory.geometry",
    "dtype_bytes": "posttrain.memory.estimate",
    "training_activation_bytes": "posttrain.memory.estimate",
    "forward_working_bytes": "posttrain.memory.estimate",
    "logit_bytes": "posttrain.memory.estimate",
    "release_knobs": "posttrain.memory.estimate",
    "ReleaseKnob": "posttrain.memory.estimate",
    "adam_trainer_state": "posttrain.memory.estimate",
    "hf_trainer_phases": "posttrain.memory.estimate",
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


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what type checkers see of the names above (a test keeps both lists equal)
    from posttrain.algorithms.registry import (
        AdvantageEstimator,
        Advantages,
        AlgorithmPreset,
        PolicyLossTerm,
    )
    from posttrain.backends.distributed import (
        agree_max,
        backend_for,
        collective_timeout_s,
        destroy_default_process_group,
        init_default_process_group,
    )
    from posttrain.backends.lora import (
        LORA_ADAPTER,
        LORA_RECORD,
        check_lora_record,
        is_lora_adapter_entry,
        lora_adapter_keys,
        lora_args,
        lora_base_model,
        lora_layers,
        lora_plain_name,
        lora_record,
        merge_lora_weight,
        wrap_lora,
        write_lora_adapter,
    )
    from posttrain.backends.models import (
        DTYPES,
        HEAD_WEIGHT,
        load_causal_lm,
        load_model_with_head,
        load_tokenizer,
        resolve_model_path,
        torch_dtype,
    )
    from posttrain.backends.plumbing import (
        MEMORY_TAGS,
        adamw,
        drain,
        enable_gradient_checkpointing,
        end_process_group,
        export_dtype,
        forward_logits,
        is_cuda,
        is_rank0,
        leads_replica,
        log_once,
        memory_tags,
        move_optimizer_state,
        rank_device,
        restore_rng_state,
        rng_state,
        save_tokenizer_beside,
        settle_cuda,
        tensor_parallel_replicas,
    )
    from posttrain.backends.safetensors_shards import export_streamed, write_shards
    from posttrain.backends.tensors import unshare_storage
    from posttrain.checkpoint.background import BackgroundSave
    from posttrain.checkpoint.digests import FileDigests, HashingStream
    from posttrain.checkpoint.host_buffers import HostBuffers, write_threads
    from posttrain.config.ranges import at_least, between, greater_than
    from posttrain.config.report import ErrorReport, did_you_mean, join_path, unknown_keys
    from posttrain.config.scoring_options import ScoringOptions
    from posttrain.config.sections import GeneratingArgs, ModelArgs, TrainingArgs, Workflow
    from posttrain.errors import (
        CheckpointError,
        PluginError,
        PluginWarning,
        PosttrainError,
        UserError,
        WorkerError,
    )
    from posttrain.hf_progress import no_hf_progress_bars
    from posttrain.host.doctor import EnvCheck, module_version
    from posttrain.host.engine_hooks import EngineHooks
    from posttrain.host.engine_protocols import Engine, RolloutEngine, TrainEngine
    from posttrain.host.strategy import Capabilities, StrategySpec
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain.memory.estimate import (
        MemoryQuery,
        ReleaseKnob,
        RoleMemory,
        Workload,
        adam_trainer_state,
        dtype_bytes,
        forward_working_bytes,
        hf_trainer_phases,
        logit_bytes,
        release_knobs,
        training_activation_bytes,
    )
    from posttrain.memory.geometry import ModelGeometry
    from posttrain.protocol import (
        GenerationRequest,
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
    from posttrain.scoring.logprob_head import TokenLogprobs, logprob_forward
    from posttrain.scoring.modeling import (
        sequence_scores,
        shifted_entropy,
        shifted_token_logprobs,
        shifted_values,
    )
    from posttrain.tasks.presets import PRESETS, is_preset
    from posttrain.trainer.logger_spec import LoggerContext, LoggerSpec
    from posttrain.training.lr_schedule import lr_lambda
    from posttrain.training.micro_batching import fixed_micro_batches, token_budget_micro_batches
    from posttrain.training.rank_batches import (
        accumulate_gradients,
        micro_batch_size,
        plan_micro_batches,
        score_logprobs,
        score_rows,
        score_sequences,
        score_values,
    )
    from posttrain.weight_sync.transport import WeightTransport
