"""Test support: DELIBERATELY BROKEN trainers, for the conformance kit's own tests only.

Each is the example's ``ddp_train`` (examples/third_party_plugin, a correct trainer) with one
bug a backend author could make, as the kit must catch it and name it:

* ``broken_no_allreduce``: gradients are never all-reduced, so the replicas drift apart;
* ``broken_scheduler_not_restored``: load_checkpoint leaves the schedule at its start;
* ``broken_optimizer_not_restored``: load_checkpoint leaves the optimizer with no state;
* ``broken_rank0_only_export``: only rank 0 yields weight-sync buckets;
* ``broken_no_memory_hooks``: no release_memory, resume_memory nor shutdown_worker.

Loaded as workflow plugins (``broken_trainers:dispatching``, ``broken_trainers:no_memory``),
with ``tests/core`` and the example's ``src`` on ``PYTHONPATH``.
"""

from __future__ import annotations

from posttrain_example_plugin.ddp_plugin import DDPTrainConfig
from posttrain_example_plugin.ddp_plugin import plugin as example

from posttrain import EngineHooks, StrategySpec, hookimpl

BUGS = {
    "broken_no_allreduce": "gradients never all-reduced",
    "broken_scheduler_not_restored": "scheduler not restored by load_checkpoint",
    "broken_optimizer_not_restored": "optimizer state not restored by load_checkpoint",
    "broken_rank0_only_export": "ranks other than 0 yield no buckets",
}
NO_MEMORY_HOOKS = "broken_no_memory_hooks"


def _specs(names) -> list[StrategySpec]:
    correct = example.posttrain_add_strategies()[0]
    return [
        StrategySpec(
            name=name,
            config_class=DDPTrainConfig,
            capabilities=correct.capabilities,
            description=f"BROKEN on purpose: {BUGS.get(name, 'no memory or shutdown hooks')}",
        )
        for name in names
    ]


class Dispatching(EngineHooks):
    """The four bugs of :data:`BUGS`: one engine module, its functions picking the bug by the
    strategy's name."""

    strategies = tuple(BUGS)
    engine = "broken_trainer_engine"

    @hookimpl
    def posttrain_add_strategies(self):
        return _specs(self.strategies)


class NoMemory(EngineHooks):
    strategies = (NO_MEMORY_HOOKS,)
    engine = "broken_trainer_engine_no_memory"

    @hookimpl
    def posttrain_add_strategies(self):
        return _specs(self.strategies)


dispatching = Dispatching()
no_memory = NoMemory()
