"""Test-only plugin, loaded through a workflow's ``plugins:`` list: kills the driver with SIGKILL
while a checkpoint is being written (after a role saved its state, or began saving it in the
background, before the manifest exists).

Enabled by ``POSTTRAIN_TEST_CRASH_AT_CHECKPOINT=N`` (the step whose checkpoint is interrupted).
"""

import os
import signal

from posttrain import hookimpl


def _maybe_crash(worker, path) -> None:
    step = os.environ.get("POSTTRAIN_TEST_CRASH_AT_CHECKPOINT")
    if step and f".checkpoint-{step}.tmp" in path and worker.rank == 0:
        os.kill(int(os.environ["POSTTRAIN_DRIVER_PID"]), signal.SIGKILL)


@hookimpl(wrapper=True)
def posttrain_save_checkpoint(worker, path):
    result = yield
    _maybe_crash(worker, path)
    return result


@hookimpl(wrapper=True)
def posttrain_begin_checkpoint(worker, path):
    result = yield
    _maybe_crash(worker, path)
    return result
