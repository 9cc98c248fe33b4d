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
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, ClassVar

from posttrain import hookimpl


class EngineHooks:
    strategies: ClassVar[tuple[str, ...]] = ()
    engine: ClassVar[str] = ""

    def _call(self, name: str, worker, *args: Any) -> Any:
        if worker.strategy_name not in self.strategies:
            return None
        module: ModuleType = importlib.import_module(self.engine)
        fn = getattr(module, name, None)
        return fn(worker, *args) if fn is not None else None

    @hookimpl(trylast=True)
    def posttrain_setup_parallel(self, worker):
        return self._call("setup_parallel", worker)

    @hookimpl(trylast=True)
    def posttrain_load_model(self, worker):
        return self._call("load_model", worker)

    @hookimpl(trylast=True)
    def posttrain_generate(self, worker, request):
        return self._call("generate", worker, request)

    @hookimpl(trylast=True)
    def posttrain_compute_logprobs(self, worker, batch):
        return self._call("compute_logprobs", worker, batch)

    @hookimpl(trylast=True)
    def posttrain_compute_values(self, worker, batch):
        return self._call("compute_values", worker, batch)

    @hookimpl(trylast=True)
    def posttrain_compute_scores(self, worker, batch):
        return self._call("compute_scores", worker, batch)

    @hookimpl(trylast=True)
    def posttrain_train_step(self, worker, batch, loss_fn):
        return self._call("train_step", worker, batch, loss_fn)

    @hookimpl(trylast=True)
    def posttrain_export_weights(self, worker, bucket_bytes, in_process):
        return self._call("export_weights", worker, bucket_bytes, in_process)

    @hookimpl(trylast=True)
    def posttrain_import_weights(self, worker, buckets):
        return self._call("import_weights", worker, buckets)

    @hookimpl(trylast=True)
    def posttrain_weight_receiver(self, worker):
        return self._call("weight_receiver", worker)

    @hookimpl(trylast=True)
    def posttrain_save_checkpoint(self, worker, path):
        return self._call("save_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_begin_checkpoint(self, worker, path):
        return self._call("begin_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_finish_checkpoint(self, worker, path):
        return self._call("finish_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_load_checkpoint(self, worker, path):
        return self._call("load_checkpoint", worker, path)

    @hookimpl(trylast=True)
    def posttrain_export_hf(self, worker, path):
        return self._call("export_hf", worker, path)

    @hookimpl(trylast=True)
    def posttrain_release_memory(self, worker, tags):
        return self._call("release_memory", worker, tags)

    @hookimpl(trylast=True)
    def posttrain_resume_memory(self, worker, tags):
        return self._call("resume_memory", worker, tags)

    @hookimpl(trylast=True)
    def posttrain_shutdown_worker(self, worker):
        return self._call("shutdown_worker", worker)
