"""A cross-cutting plugin for benchmarks/rl_step.py --profile: torch.profiler around the rank-side
work of the loop's phases, on a chosen call of each hook.

Named in the generated workflow's ``plugins:`` (the file is copied next to it). It wraps the
worker hooks that do a phase's work (``generate``, ``compute_logprobs``, ``train_step``,
``import_weights``) and, on the ``POSTTRAIN_PROFILE_CALL``-th call of each (default 2: the first
warms up), writes the profiler's top operations by CUDA time (CPU time on a CPU) to
``$POSTTRAIN_PROFILE_DIR/<hook>.<role>.rank<R>.txt``. A measurement tool, not core: it changes
nothing a run computes.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

from posttrain import hookimpl

ROWS = 15
_calls: Counter = Counter()


@contextlib.contextmanager
def _profiled(worker, hook: str):
    out_dir = os.environ.get("POSTTRAIN_PROFILE_DIR")
    key = (hook, worker.role)
    _calls[key] += 1
    if not out_dir or _calls[key] != int(os.environ.get("POSTTRAIN_PROFILE_CALL", "2")):
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = str(worker.device).startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=ROWS, max_name_column_width=60)
    path = os.path.join(out_dir, f"{hook}.{worker.role}.rank{worker.rank}.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(table)


@hookimpl(wrapper=True)
def posttrain_generate(worker, request):
    with _profiled(worker, "generate"):
        return (yield)


@hookimpl(wrapper=True)
def posttrain_compute_logprobs(worker, batch):
    with _profiled(worker, "compute_logprobs"):
        return (yield)


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    with _profiled(worker, "train_step"):
        return (yield)


@hookimpl(wrapper=True)
def posttrain_import_weights(worker, buckets):
    with _profiled(worker, "import_weights"):
        return (yield)
