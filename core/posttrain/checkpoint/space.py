"""A save that ran out of disk space: recognised wherever it happened (a rank's write, its
background thread, the driver's own files), and told as a user error with the figures."""

from __future__ import annotations

import errno
import os
import shutil

from posttrain.checkpoint import manager
from posttrain.errors import CheckpointError, WorkerError
from posttrain.paths import display_path

# How a rank's OSError(ENOSPC) reads once it crossed a process boundary as text.
_SIGNS = (f"[Errno {errno.ENOSPC}]", os.strerror(errno.ENOSPC))


def out_of_space(failure: BaseException | str) -> bool:
    if isinstance(failure, OSError):
        return failure.errno == errno.ENOSPC
    text = str(failure)
    if isinstance(failure, WorkerError):
        text += failure.remote_traceback or ""
    return any(sign in text for sign in _SIGNS)


def tree_bytes(path: str) -> int:
    """The bytes of every file under ``path`` (a checkpoint's size)."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def no_space_error(run_dir: str, step: int, tmp: str) -> CheckpointError:
    """The error for the checkpoint of ``step`` (written into ``tmp``) that found the disk of
    ``run_dir`` full: how much a checkpoint takes, how much is free, what to change."""
    free = shutil.disk_usage(run_dir).free
    latest = manager.latest_checkpoint(run_dir)
    if latest is not None:
        need = f"about {_gib(tree_bytes(latest))} (the size of {display_path(latest)})"
        intact = f"; {display_path(latest)} is complete and untouched"
    else:
        need = f"more than the {_gib(tree_bytes(tmp) if os.path.isdir(tmp) else 0)} written"
        intact = ""
    return CheckpointError(
        f"checkpoint {step} could not be written: no space left on the device of "
        f"{display_path(run_dir)} ({_gib(free)} free); a checkpoint of this run takes {need}"
        f"{intact}. Free space there, keep fewer checkpoints (trainer.save_total_limit), or "
        "write the run elsewhere (trainer.output_dir)"
    )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
