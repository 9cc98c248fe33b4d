"""The ``hf_infer`` strategy: rollout and log-probs on plain transformers (the reference backend).

This module is cheap to import; the engine code lives in :mod:`posttrain.builtin.hf_infer` and is
imported by the hooks when a rank first needs it.
"""

from __future__ import annotations

import attrs

from posttrain import hookimpl
from posttrain.strategy import Capabilities, StrategySpec

STRATEGY = "hf_infer"


@attrs.frozen(kw_only=True)
class HFInferConfig:
    """``strategy_config`` of ``hf_infer``."""

    # Prompts per forward pass when generating or scoring (the role's infer_batch_size wins).
    batch_size: int = 64
    use_cache: bool = True


@hookimpl
def posttrain_add_strategies():
    return [
        StrategySpec(
            name=STRATEGY,
            config_class=HFInferConfig,
            capabilities=Capabilities(
                kind="rollout", import_transports=("shared_memory", "broadcast")
            ),
            description="generation and log-probs with plain transformers (reference backend)",
        )
    ]


def _engine(worker):
    if worker.strategy_name != STRATEGY:
        return None
    from posttrain.builtin import hf_infer

    return hf_infer


@hookimpl(trylast=True)
def posttrain_setup_parallel(worker):
    engine = _engine(worker)
    return engine.setup_parallel(worker) if engine else None


@hookimpl(trylast=True)
def posttrain_load_model(worker):
    engine = _engine(worker)
    return engine.load_model(worker) if engine else None


@hookimpl(trylast=True)
def posttrain_generate(worker, request):
    engine = _engine(worker)
    return engine.generate(worker, request) if engine else None


@hookimpl(trylast=True)
def posttrain_compute_logprobs(worker, batch):
    engine = _engine(worker)
    return engine.compute_logprobs(worker, batch) if engine else None


@hookimpl(trylast=True)
def posttrain_import_weights(worker, buckets):
    engine = _engine(worker)
    return engine.import_weights(worker, buckets) if engine else None


@hookimpl(trylast=True)
def posttrain_save_checkpoint(worker, path):
    engine = _engine(worker)
    return engine.save_checkpoint(worker, path) if engine else None


@hookimpl(trylast=True)
def posttrain_load_checkpoint(worker, path):
    engine = _engine(worker)
    return engine.load_checkpoint(worker, path) if engine else None


@hookimpl(trylast=True)
def posttrain_export_hf(worker, path):
    engine = _engine(worker)
    return engine.export_hf(worker, path) if engine else None


@hookimpl(trylast=True)
def posttrain_release_memory(worker, tags):
    engine = _engine(worker)
    return engine.move_model(worker, "cpu") if engine else None


@hookimpl(trylast=True)
def posttrain_resume_memory(worker, tags):
    engine = _engine(worker)
    return engine.move_model(worker, worker.device) if engine else None


@hookimpl(trylast=True)
def posttrain_shutdown_worker(worker):
    return True if _engine(worker) else None
