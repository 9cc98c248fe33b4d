"""Test support: ``contract_fake_export``, a FAKE 'train' strategy for core contract tests only.

It trains nothing. It loads the tiny model and exports a perturbed copy of its weights (seeded
noise) so that a weight import on the rollout side is observable. Worker processes load it
through ``GroupSpec.plugins=("export_source_plugin",)`` with ``tests/core`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import attrs

from posttrain import hookimpl
from posttrain.host.strategy import Capabilities, StrategySpec

STRATEGY = "contract_fake_export"
_SEED = "contract_fake_export_seed"


@attrs.frozen(kw_only=True)
class ContractFakeExportConfig:
    seed: int = 7
    scale: float = 0.05


def perturbed_weights(model, seed: int, scale: float) -> list:
    """``model``'s state dict plus seeded noise, in state-dict order; a tied weight appears once
    (under its first name), as it does in a saved HF checkpoint."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        out.append((name, (tensor.detach().float() + scale * noise).to(tensor.dtype)))
    return out


def set_export_seed(runtime, seed: int) -> bool:
    """``run_function`` target: the seed of the next exports."""
    runtime.ctx.state[_SEED] = int(seed)
    return True


def _mine(worker) -> bool:
    return worker.strategy_name == STRATEGY


@hookimpl
def posttrain_add_strategies():
    return [
        StrategySpec(
            name=STRATEGY,
            config_class=ContractFakeExportConfig,
            capabilities=Capabilities(kind="train", exports_hf_weights=True),
            description="FAKE export-only strategy for core transport tests",
        )
    ]


@hookimpl
def posttrain_setup_parallel(worker):
    return {"dp_rank": worker.rank, "dp_size": worker.world_size} if _mine(worker) else None


@hookimpl
def posttrain_load_model(worker):
    if not _mine(worker):
        return None
    from posttrain.backends.models import load_causal_lm

    return load_causal_lm(worker.model_args, worker.base_dir, worker.device).eval()


@hookimpl
def posttrain_export_weights(worker, bucket_bytes):
    if not _mine(worker):
        return None
    from posttrain.protocol import bucketize

    config = worker.config
    seed = worker.state.get(_SEED, config.seed)
    return bucketize(perturbed_weights(worker.model, seed, config.scale), bucket_bytes)


@hookimpl
def posttrain_shutdown_worker(worker):
    return True if _mine(worker) else None
