"""Worker hooks answered by an engine module, for plugins that own strategies.

A strategy plugin subclasses :class:`EngineHooks`, names its strategies and the module holding its
engine functions, and adds its driver hooks (``posttrain_add_strategies``, checks) as methods::

    class FSDPPlugin(EngineHooks):
        strategies = ("fsdp2_train", "fsdp2_infer")
        engine = "posttrain_fsdp.engine"

    plugin = FSDPPlugin()          # the entry point: "posttrain_fsdp.plugin:plugin"

Each worker hook ``posttrain_X(worker, ...)`` calls ``engine.X(worker, ...)`` for the plugin's own
strategies and returns None for the others (firstresult dispatch by strategy name); the rule has
no exception (``posttrain_shutdown_worker`` calls ``engine.shutdown_worker``). The engine
module is imported on first use, so the plugin module stays cheap; a missing engine function
means the strategy does not support that call. The implementations are ``trylast``: another
plugin answering for the same strategy overrides them, a wrapper can wrap them.

Since a misnamed engine function is simply never called, the plugin host warns when it registers
an ``EngineHooks`` whose engine module (read from its source, not imported) defines a public name
that is close to one of :data:`ENGINE_FUNCTIONS` but not one of them
(:func:`warn_misnamed_engine_functions`).
"""

from __future__ import annotations

import difflib
import importlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from posttrain.errors import PluginWarning
from posttrain.host.engine_source import engine_names
from posttrain.markers import hookimpl

if TYPE_CHECKING:
    import torch

    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import GenerationRequest, RolloutSamples, SequenceBatch, WeightBucket


class EngineHooks:
    strategies: ClassVar[tuple[str, ...]] = ()
    engine: ClassVar[str] = ""
    # Modules worth importing once in the CPU fork server that local ranks are forked from (the
    # engine's heavy library), rather than in every rank; nothing that starts a thread or asks
    # a GPU anything at import.
    preload: ClassVar[tuple[str, ...]] = ()

    def _call(self, name: str, worker: WorkerContext, *args: Any) -> Any:
        if worker.strategy_name not in self.strategies:
            return None
        module: ModuleType = importlib.import_module(self.engine)
        fn = getattr(module, name, None)
        return fn(worker, *args) if fn is not None else None

    @hookimpl(trylast=True)
    def posttrain_setup_parallel(self, worker: WorkerContext) -> dict[str, int] | None:
        return self._call("setup_parallel", worker)

    @hookimpl(trylast=True)
    def posttrain_load_model(self, worker: WorkerContext) -> Any:
        return self._call("load_model", worker)

    @hookimpl(trylast=True)
    def posttrain_generate(
        self, worker: WorkerContext, request: GenerationRequest
    ) -> RolloutSamples | None:
        return self._call("generate", worker, request)

    @hookimpl(trylast=True)
    def posttrain_compute_logprobs(
        self, worker: WorkerContext, batch: SequenceBatch
    ) -> torch.Tensor | None:
        return self._call("compute_logprobs", worker, batch)

    @hookimpl(trylast=True)
    def posttrain_compute_values(
        self, worker: WorkerContext, batch: SequenceBatch
    ) -> torch.Tensor | None:
        return self._call("compute_values", worker, batch)

    @hookimpl(trylast=True)
    def posttrain_compute_scores(
        self, worker: WorkerContext, batch: SequenceBatch
    ) -> torch.Tensor | None:
        return self._call("compute_scores", worker, batch)

    @hookimpl(trylast=True)
    def posttrain_train_step(
        self, worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any]
    ) -> dict[str, float] | None:
        return self._call("train_step", worker, batch, loss_fn)

    @hookimpl(trylast=True)
    def posttrain_export_weights(
        self, worker: WorkerContext, bucket_bytes: int, on_device: bool
    ) -> Iterator[WeightBucket] | None:
        return self._call("export_weights", worker, bucket_bytes, on_device)

    @hookimpl(trylast=True)
    def posttrain_import_weights(
        self, worker: WorkerContext, buckets: Iterable[WeightBucket]
    ) -> bool | None:
        return self._call("import_weights", worker, buckets)

    @hookimpl(trylast=True)
    def posttrain_weight_shapes(self, worker: WorkerContext) -> dict[str, tuple[int, ...]] | None:
        return self._call("weight_shapes", worker)

    @hookimpl(trylast=True)
    def posttrain_weight_receiver(self, worker: WorkerContext) -> Any:
        return self._call("weight_receiver", worker)

    @hookimpl(trylast=True)
    def posttrain_save_checkpoint(self, worker: WorkerContext, path: str) -> dict[str, Any] | None:
        return self._call("save_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_begin_checkpoint(self, worker: WorkerContext, path: str) -> dict[str, Any] | None:
        return self._call("begin_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_finish_checkpoint(self, worker: WorkerContext, path: str) -> bool | None:
        return self._call("finish_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_load_checkpoint(self, worker: WorkerContext, path: str) -> bool | None:
        return self._call("load_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_export_hf(self, worker: WorkerContext, path: str, merge: bool) -> bool | None:
        # ``merge`` only reaches engines of strategies with the ``lora`` capability.
        args = (path, True) if merge else (path,)
        return self._call("export_hf", worker, *args)

    @hookimpl(trylast=True)
    def posttrain_release_memory(self, worker: WorkerContext, tags: list[str]) -> bool | None:
        return self._call("release_memory", worker, tags)

    @hookimpl(trylast=True)
    def posttrain_resume_memory(self, worker: WorkerContext, tags: list[str]) -> bool | None:
        return self._call("resume_memory", worker, tags)

    @hookimpl(trylast=True)
    def posttrain_shutdown_worker(self, worker: WorkerContext) -> bool | None:
        return self._call("shutdown_worker", worker)


# The engine functions EngineHooks calls, one per worker hook: posttrain_X calls X.
ENGINE_FUNCTIONS = tuple(
    sorted(n.removeprefix("posttrain_") for n in vars(EngineHooks) if n.startswith("posttrain_"))
)


def misnamed_engine_functions(plugin: EngineHooks) -> list[tuple[str, str]]:
    """``(name, meant)`` for each public function or imported name of the plugin's engine module
    that EngineHooks never calls but that looks meant as one it calls (``meant``: its name, or
    the candidates joined by " or "). Empty when the source cannot be read."""
    names = engine_names(plugin.engine) or ()
    return [(name, meant) for name in sorted(names) if (meant := _meant(name))]


def _meant(name: str) -> str:
    if name.startswith("_") or name in ENGINE_FUNCTIONS:
        return ""
    bare = name.removeprefix("posttrain_")  # the hook's name instead of the function's
    if bare in ENGINE_FUNCTIONS:
        return bare
    # A leading part of a function's name: "shutdown" for shutdown_worker, "train" for train_step.
    longer = [f for f in ENGINE_FUNCTIONS if f.startswith(f"{bare}_")]
    if longer:
        return " or ".join(longer)
    close = difflib.get_close_matches(bare, ENGINE_FUNCTIONS, n=1, cutoff=0.8)  # a typo
    return close[0] if close else ""


def warn_misnamed_engine_functions(plugin: EngineHooks, plugin_name: str) -> None:
    """One :class:`~posttrain.errors.PluginWarning` per :func:`misnamed_engine_functions`."""
    for name, meant in misnamed_engine_functions(plugin):
        warnings.warn(
            f"plugin '{plugin_name}': {plugin.engine}.{name} is never called (EngineHooks calls "
            f"the engine function named after each worker hook, posttrain_X -> X); "
            f"name it {meant}",
            PluginWarning,
            stacklevel=2,
        )
