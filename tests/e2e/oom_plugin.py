"""Test-only plugin, loaded through a workflow's ``plugins:`` list: every rank's train step of
step ``POSTTRAIN_TEST_OOM_AT_STEP`` raises the error torch raises when a GPU runs out of memory
(a CPU run cannot run out of GPU memory; what is tested is how posttrain reports it)."""

import os

import attrs
import torch

from posttrain import hookimpl


@attrs.define
class TrainSteps:
    """This plugin's own count of the role's train steps (the engine's state is its own)."""

    count: int = 0


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    steps = worker.engine_state(TrainSteps)
    steps.count += 1
    if steps.count == int(os.environ.get("POSTTRAIN_TEST_OOM_AT_STEP", "0")):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 3.99 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.02 GiB is free."
        )
    return (yield)
