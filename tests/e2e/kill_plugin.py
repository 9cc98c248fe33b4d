"""Test-only plugin, loaded through a workflow's ``plugins:`` list: kills one training rank's
process (``os._exit(1)``) at the start of its N-th train step, as a crashed node would.

Enabled by ``POSTTRAIN_TEST_KILL_AT_STEP=N`` (forwarded to the ranks through
``cluster.runtime_env.env_vars``); ``POSTTRAIN_TEST_KILL_RANK`` picks the rank (default 1).
"""

import os

from posttrain import hookimpl

_calls = {"train_step": 0}


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    _calls["train_step"] += 1
    step = os.environ.get("POSTTRAIN_TEST_KILL_AT_STEP")
    rank = int(os.environ.get("POSTTRAIN_TEST_KILL_RANK", "1"))
    if step and _calls["train_step"] == int(step) and worker.rank == rank:
        print(f"kill_plugin: exiting rank {worker.rank} at train step {step}", flush=True)
        os._exit(1)
    return (yield)
