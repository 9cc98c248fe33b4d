"""What an engine module must define, as protocols the type checker reads.

An engine is a module of functions (``EngineHooks.engine`` names it); a plugin states which kind
its engine is with one line that only mypy runs::

    if TYPE_CHECKING:
        from posttrain_fsdp import engine

        _ENGINE: TrainEngine = engine  # a missing or mis-signed function fails the type check

mypy matches a module against a protocol function by function (without ``self``), so deleting a
required function, or changing its parameters or return type, fails ``mypy`` in CI rather than a
run. Parameters are positional-only here: engines name theirs as they like.

Functions an engine may leave out (the call is then unsupported: ``compute_values``,
``compute_scores``, ``begin_checkpoint`` / ``finish_checkpoint``, ``weight_shapes``,
``weight_receiver``) are not in the protocols; :data:`~posttrain.host.engine_hooks.ENGINE_FUNCTIONS`
lists every function EngineHooks forwards, and a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import GenerationRequest, RolloutSamples, SequenceBatch, WeightBucket


class Engine(Protocol):
    """Every engine: the model built on the rank, memory released and resumed around the other
    roles' phases on shared GPUs, and an orderly end."""

    def setup_parallel(self, worker: WorkerContext, /) -> dict[str, int]: ...

    def load_model(self, worker: WorkerContext, /) -> Any: ...

    def release_memory(self, worker: WorkerContext, tags: list[str], /) -> bool: ...

    def resume_memory(self, worker: WorkerContext, tags: list[str], /) -> bool: ...

    def shutdown_worker(self, worker: WorkerContext, /) -> bool: ...


class TrainEngine(Engine, Protocol):
    """A trainer (``Capabilities.kind == "train"``): updates, log-probs of its own policy, its
    weights exported to a rollout engine, checkpoints and a Hugging Face export."""

    def train_step(
        self, worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any], /
    ) -> dict[str, float]: ...

    def compute_logprobs(self, worker: WorkerContext, batch: SequenceBatch, /) -> torch.Tensor: ...

    def export_weights(
        self, worker: WorkerContext, bucket_bytes: int, on_device: bool, /
    ) -> Iterator[WeightBucket]: ...

    def save_checkpoint(self, worker: WorkerContext, path: str, /) -> dict[str, Any]: ...

    def load_checkpoint(self, worker: WorkerContext, path: str, /) -> bool: ...

    def export_hf(self, worker: WorkerContext, path: str, /) -> bool: ...


class RolloutEngine(Engine, Protocol):
    """A rollout engine (``Capabilities.kind == "rollout"``): samples, the log-probs of given
    sequences, and the trainer's weights taken in."""

    def generate(self, worker: WorkerContext, request: GenerationRequest, /) -> RolloutSamples: ...

    def compute_logprobs(self, worker: WorkerContext, batch: SequenceBatch, /) -> torch.Tensor: ...

    def import_weights(self, worker: WorkerContext, buckets: Any, /) -> bool: ...
