"""One rank's checkpoint writes in flight, and the completion marker that tells the driver so.

A rank that saves in the background (``posttrain_begin_checkpoint``) writes, once every one of
its files under the role's checkpoint directory is complete and fsynced, a marker
``.complete-rank<r>.json`` holding the sha256 of each file it wrote (computed while writing) or
the error that stopped it. The driver's checkpoint finaliser waits for the markers of every rank
of every role, then writes the manifest and renames the checkpoint into place; it never calls a
rank, so training goes on meanwhile. Markers are removed before the manifest is written.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

from posttrain.checkpoint.digests import FileDigests
from posttrain.errors import CheckpointError

MARKER_PREFIX = ".complete-rank"


def marker_path(role_dir: str, rank: int) -> str:
    return os.path.join(role_dir, f"{MARKER_PREFIX}{rank}.json")


def read_marker(role_dir: str, rank: int) -> dict | None:
    """The marker's content, or None while the rank has not written it."""
    try:
        with open(marker_path(role_dir, rank), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_marker(role_dir: str, rank: int, files: dict[str, str], error: str | None) -> None:
    final = marker_path(role_dir, rank)
    part = final + ".part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "files": files, "error": error}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, final)  # whole or absent: the driver never reads half a marker


class BackgroundSave:
    """Runs a rank's file writes on a thread; :meth:`complete` writes the marker.

    ``finalize_on_main`` is for engines whose last step (e.g. megatron's metadata gather) must
    run on the main thread in a collective: the thread then only writes, and the engine calls
    :meth:`complete` after that step; otherwise the thread writes the marker itself.
    """

    def __init__(self, role_dir: str, rank: int, finalize_on_main: bool = False):
        self.role_dir = role_dir
        self.rank = rank
        self.digests = FileDigests(role_dir)
        self.finalize_on_main = finalize_on_main
        self.error: BaseException | None = None
        self.completed = False
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[], object]) -> None:
        def run() -> None:
            try:
                write()
            except BaseException as exc:  # reported through the marker and by wait()
                self.error = exc
                self.complete()
                return
            if not self.finalize_on_main:
                self.complete()

        self._thread = threading.Thread(target=run, name="posttrain-checkpoint", daemon=True)
        self._thread.start()

    def written(self) -> bool:
        """Whether the thread has finished writing (without blocking)."""
        return self._thread is None or not self._thread.is_alive()

    def wait_written(self) -> None:
        """Block until the thread has finished writing, failed or not."""
        if self._thread is not None:
            self._thread.join()

    def join(self) -> None:
        """Block until the thread has finished; raise what stopped it."""
        self.wait_written()
        if self.error is not None:
            raise CheckpointError(
                f"background checkpoint write into {self.role_dir} failed on rank {self.rank}: "
                f"{self.error}"
            ) from self.error

    def complete(self) -> None:
        if self.completed:
            return
        self.completed = True
        error = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        write_marker(self.role_dir, self.rank, self.digests.relative(), error)
