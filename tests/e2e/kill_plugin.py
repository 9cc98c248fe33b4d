"""Test-only plugin, loaded through a workflow's ``plugins:`` list: kills one training rank's
process (``os._exit(1)``) at the start of its N-th train step, as a crashed node would.

Enabled by ``POSTTRAIN_TEST_KILL_AT_STEP=N`` (forwarded to the ranks through
``cluster.runtime_env.env_vars``); ``POSTTRAIN_TEST_KILL_RANK`` picks the rank (default 1);
``POSTTRAIN_TEST_KILL_SIGNAL=SIGSEGV`` (or another signal's name) has the process die of that
signal instead, as one that crashes in native code does.
"""

import os
import signal

from posttrain import hookimpl

_calls = {"train_step": 0}


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    _calls["train_step"] += 1
    step = os.environ.get("POSTTRAIN_TEST_KILL_AT_STEP")
    rank = int(os.environ.get("POSTTRAIN_TEST_KILL_RANK", "1"))
    if step and _calls["train_step"] == int(step) and worker.rank == rank:
        signal_name = os.environ.get("POSTTRAIN_TEST_KILL_SIGNAL")
        print(f"kill_plugin: exiting rank {worker.rank} at train step {step}", flush=True)
        if signal_name:
            os.kill(os.getpid(), signal.Signals[signal_name])
        os._exit(1)
    return (yield)
