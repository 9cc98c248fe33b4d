"""Faults on purpose: a plugin that makes a run fail in the ways real clusters do, for tests and
for rehearsing a cluster before a long run.

Load it as a workflow plugin and name the faults in ``POSTTRAIN_FAULTS``, which the rank
processes must see too (``cluster.runtime_env.env_vars``)::

    posttrain run wf.yaml --set "plugins=[posttrain.testing.faults]" \\
        --set cluster.runtime_env.env_vars.POSTTRAIN_FAULTS=kill_rank:5/rank=1

``POSTTRAIN_FAULTS`` is a comma-separated list of ``KIND:N`` with options ``/key=value``; ``N``
counts the calls of the phase on that process (the first is 1):

- ``delay_train:N/rank=R/seconds=S``: rank R (default 0) sleeps S seconds (default 3600) at
  the start of its N-th training step, as a rank stuck in a kernel or on a bad node would;
- ``kill_rank:N/rank=R/phase=P/role=X/after_s=S``: rank R SIGKILLs itself at the start of its
  N-th call of phase P: ``train`` (a training step, the default), ``generate`` (a generation, or
  one segment of a partial rollout: samples are in flight), ``sync`` (loading a weight sync's
  buckets) or ``save`` (a checkpoint save; with ``after_s`` the kill lands while the background
  write is under way, or after it). ``role`` restricts it to one role of a process that hosts
  several (rank R of that role); ``after_s``: S seconds after the call returns instead, wherever
  the process then is;
- ``kill_driver:N/after_s=S``: the driver SIGKILLs itself once step N's metrics are logged (or
  S seconds later: inside the next step, or the save the finaliser is completing);
- ``enospc_save:N/rank=R``: rank R's N-th checkpoint save of ``actor_train`` fails with
  "No space left on device" (ENOSPC);
- ``flip_saved_byte:N``: once the N-th checkpoint of the run is complete, one byte of its
  largest file is flipped (a disk or copy that corrupted it);
- ``corrupt_sync:N``: in the N-th weight sync, one value of the first tensor sent changes on the
  way (after the trainer's byte sums: a link or a transport that corrupted it);
- ``rename_sync:N``: in the N-th weight sync, the first tensor sent arrives under another name
  (an engine upgrade that renamed a parameter).

What each fault does to a run is what :doc:`docs/reliability.md` promises: a clear error naming
who or what, no process left behind, and a rerun that resumes as the same run.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import threading
import time
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.markers import hookimpl

if TYPE_CHECKING:
    from posttrain.checkpoint.manifest import Manifest
    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import GenerationRequest, RolloutSamples, SequenceBatch, WeightBucket

# The phases kill_rank can kill in, and the hook each is counted by.
KILL_PHASES = ("train", "generate", "sync", "save")

KINDS = (
    "delay_train",
    "kill_rank",
    "kill_driver",
    "enospc_save",
    "flip_saved_byte",
    "corrupt_sync",
    "rename_sync",
)


@attrs.frozen
class Fault:
    kind: str
    at: int  # the N-th call of the phase
    options: dict[str, str] = attrs.field(factory=dict)

    def rank(self) -> int:
        return int(self.options.get("rank", 0))


def parse_faults(text: str) -> list[Fault]:
    """``POSTTRAIN_FAULTS``'s faults; a malformed entry is an error naming it."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        head, *options = entry.split("/")
        kind, _, at = head.partition(":")
        if kind not in KINDS or not at.isdigit() or int(at) < 1:
            raise ValueError(
                f"POSTTRAIN_FAULTS entry {entry!r}: expected KIND:N (N >= 1) with KIND one of "
                f"{', '.join(KINDS)}"
            )
        pairs = dict(option.partition("=")[::2] for option in options)
        if pairs.get("phase", "train") not in KILL_PHASES:
            raise ValueError(
                f"POSTTRAIN_FAULTS entry {entry!r}: phase {pairs['phase']!r} is not one of "
                f"{', '.join(KILL_PHASES)}"
            )
        faults.append(Fault(kind, int(at), pairs))
    return faults


def _faults(kind: str) -> list[Fault]:
    return [f for f in _parsed(os.environ.get("POSTTRAIN_FAULTS", "")) if f.kind == kind]


@functools.cache
def _parsed(text: str) -> tuple[Fault, ...]:
    # (asked at every train step and export: read once per value of the variable)
    return tuple(parse_faults(text))


_calls: dict[str, int] = {}


def _count(phase: str) -> int:
    _calls[phase] = _calls.get(phase, 0) + 1
    return _calls[phase]


@hookimpl(wrapper=True)
def posttrain_train_step(
    worker: WorkerContext, batch: SequenceBatch, loss_fn: Any
) -> Generator[None, dict[str, float] | None, dict[str, float] | None]:
    call = _count(f"train_step:{worker.role}")
    for fault in _faults("delay_train"):
        if fault.at == call and fault.rank() == worker.rank:
            print(f"faults: rank {worker.rank} delayed at train step {call}", flush=True)
            time.sleep(float(fault.options.get("seconds", 3600)))
    return (yield from _killable(worker, "train", call))


def _killable(worker: WorkerContext, phase: str, call: int) -> Generator[None, Any, Any]:
    """The body of a wrapper around ``call`` of ``phase``: the kills aimed at its start, then
    at a moment after it returned."""
    _kill_if_asked(worker, phase, call, started=True)
    result = yield
    _kill_if_asked(worker, phase, call, started=False)
    return result


def _kill_if_asked(worker: WorkerContext, phase: str, call: int, *, started: bool) -> None:
    """SIGKILL this process for a ``kill_rank`` fault aimed at ``call`` of ``phase`` here: at
    the call's start (``started``), or ``after_s`` seconds after it returned."""
    for fault in _faults("kill_rank"):
        if (
            fault.at != call
            or fault.rank() != worker.rank
            or fault.options.get("phase", "train") != phase
            or fault.options.get("role", worker.role) != worker.role
        ):
            continue
        where = f"rank {worker.rank} kills itself"
        after = fault.options.get("after_s")
        if started and after is None:
            _kill(f"{where} at its {phase} call {call} ({worker.role})")
        elif not started and after is not None:
            _kill_later(
                float(after), f"{where} {after} s after its {phase} call {call} ({worker.role})"
            )


def _kill(why: str) -> None:
    print(f"faults: {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_later(seconds: float, why: str) -> None:
    timer = threading.Timer(seconds, _kill, args=(why,))
    timer.daemon = True
    timer.start()


@hookimpl(wrapper=True)
def posttrain_generate(
    worker: WorkerContext, request: GenerationRequest
) -> Generator[None, RolloutSamples | None, RolloutSamples | None]:
    return (yield from _killable(worker, "generate", _count(f"generate:{worker.role}")))


@hookimpl(wrapper=True)
def posttrain_import_weights(
    worker: WorkerContext, buckets: Iterable[WeightBucket]
) -> Generator[None, bool | None, bool | None]:
    return (yield from _killable(worker, "sync", _count(f"sync:{worker.role}")))


_saves: set[str] = set()


def _no_space(worker: WorkerContext, path: str) -> None:
    if worker.role != "actor_train" or path in _saves:
        return  # (a save begun in the background, or synchronously after a begin said no)
    _saves.add(path)
    call = _count("save")
    for fault in _faults("enospc_save"):
        if fault.at == call and fault.rank() == worker.rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@hookimpl(wrapper=True)
def posttrain_begin_checkpoint(
    worker: WorkerContext, path: str
) -> Generator[None, dict[str, Any] | None, dict[str, Any] | None]:
    return (yield from _saving(worker, path))


@hookimpl(wrapper=True)
def posttrain_save_checkpoint(
    worker: WorkerContext, path: str
) -> Generator[None, dict[str, Any] | None, dict[str, Any] | None]:
    return (yield from _saving(worker, path))


_saves_counted: dict[str, int] = {}


def _saving(
    worker: WorkerContext, path: str
) -> Generator[None, dict[str, Any] | None, dict[str, Any] | None]:
    """A save, background or not: ENOSPC and kills where asked. A save is counted once
    (a background save that said no is then saved synchronously, at the same path)."""
    _no_space(worker, path)
    if path not in _saves_counted:
        _saves_counted[path] = _count(f"save:{worker.role}")
    return (yield from _killable(worker, "save", _saves_counted[path]))


@hookimpl
def posttrain_log_metrics(step: int, metrics: dict[str, float], run_dir: str) -> None:
    for fault in _faults("kill_driver"):
        if fault.at != step:
            continue
        after = fault.options.get("after_s")
        if after is None:
            _kill(f"the driver kills itself once step {step} is logged")
        else:
            _kill_later(float(after), f"the driver kills itself {after} s after step {step}")


@hookimpl
def posttrain_checkpoint_saved(checkpoint_dir: str, manifest: Manifest) -> None:
    call = _count("checkpoint_saved")
    for fault in _faults("flip_saved_byte"):
        if fault.at == call:
            flip_byte(checkpoint_dir, largest_file(checkpoint_dir, manifest))


@hookimpl(wrapper=True)
def posttrain_export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool
) -> Generator[None, Iterator[WeightBucket] | None, Iterator[WeightBucket] | None]:
    buckets = yield
    call = _count(f"export:{worker.role}")
    faults = [f for f in _faults("corrupt_sync") + _faults("rename_sync") if f.at == call]
    if buckets is None or not faults:
        return buckets
    return _tampered(buckets, faults[0].kind)


def _tampered(buckets: Iterable[WeightBucket], kind: str) -> Iterator[WeightBucket]:
    done = False
    for bucket in buckets:
        if bucket and not done:
            name, tensor = bucket.tensors[0]
            if kind == "corrupt_sync":
                tensor = tensor.clone()  # (the trainer's own weights stay as they are)
                tensor.view(-1)[0] += 1
            else:
                name = name.replace("model.", "model.renamed.", 1)
            bucket.tensors[0] = (name, tensor)
            done = True
        yield bucket


def largest_file(checkpoint_dir: str, manifest: Manifest) -> str:
    return max(manifest.files, key=lambda rel: os.path.getsize(os.path.join(checkpoint_dir, rel)))


def flip_byte(checkpoint_dir: str, rel: str) -> None:
    """Invert one byte in the middle of ``rel``: its size and name stay, its content does not."""
    path = os.path.join(checkpoint_dir, rel)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
