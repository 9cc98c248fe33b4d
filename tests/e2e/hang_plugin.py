"""Test-only plugin, loaded through a workflow's ``plugins:`` list: one training rank stops
making progress at the start of its N-th train step (it sleeps in :func:`block_here`), while its
peer goes on into the step's collectives and waits there, as a rank stuck in a kernel or a bad
node would leave it.

Enabled by ``POSTTRAIN_TEST_HANG_AT_STEP=N`` (forwarded to the ranks through
``cluster.runtime_env.env_vars``); ``POSTTRAIN_TEST_HANG_RANK`` picks the rank (default 0).
"""

import os
import time

from posttrain import hookimpl

_calls = {"train_step": 0}


def block_here(rank: int) -> None:
    print(f"hang_plugin: rank {rank} blocks", flush=True)
    while True:
        time.sleep(1.0)


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    _calls["train_step"] += 1
    step = os.environ.get("POSTTRAIN_TEST_HANG_AT_STEP")
    rank = int(os.environ.get("POSTTRAIN_TEST_HANG_RANK", "0"))
    if step and _calls["train_step"] == int(step) and worker.rank == rank:
        block_here(worker.rank)
    return (yield)
