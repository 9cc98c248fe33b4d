"""The driver's side of a save: the loop waits only while the ranks copy their state to host
buffers; a finaliser thread then waits for every rank's completion marker, writes the manifest
and renames the checkpoint into place while training goes on.

At most one save is in flight: a save waits for the previous one, and so does the end of the
run (:meth:`CheckpointSaver.wait`). The finaliser never calls a rank: it only watches the files
the ranks write, so the driver's calls to its worker groups stay on the loop's thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from posttrain.checkpoint import manager
from posttrain.checkpoint import plugin_files as contributed
from posttrain.checkpoint.background import marker_path, read_marker
from posttrain.checkpoint.space import no_space_error, out_of_space, tree_bytes
from posttrain.errors import CheckpointError, WorkerError

_POLL_S = 0.01


class CheckpointSaver:
    """Saves the trained roles of a run. ``groups`` maps each trained role to its worker group
    and ``strategies`` to its strategy name; ``record`` is the run's workflow record
    (:mod:`posttrain.checkpoint.record`), written into every checkpoint; ``saved`` is called (on
    the finaliser thread for background saves) with ``(path, manifest)`` once a checkpoint is
    complete."""

    def __init__(
        self,
        run_dir: str,
        groups: dict[str, Any],
        strategies: dict[str, str],
        versions: dict[str, str],
        total_limit: int | None,
        background: bool,
        saved: Callable[[str, Any], None],
        record: bytes,
    ):
        self.run_dir = run_dir
        self.record = record
        self.groups = groups
        self.strategies = strategies
        self.versions = versions
        self.total_limit = total_limit
        self.background = background
        self.saved = saved
        self._thread: threading.Thread | None = None
        self._waiting_roles: dict[str, str] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        # Figures of the last save (benchmarks/checkpoint.py prints them).
        self.stats: dict[str, float] = {}

    def save(self, step: int, driver_state: dict[str, Any], plugin_files: dict[str, bytes]) -> None:
        """``plugin_files``: what plugins contribute (:mod:`posttrain.checkpoint.plugin_files`),
        written with the driver's state."""
        self.wait()
        start = time.perf_counter()
        # Serialised now: the loop keeps appending to the history while the save completes.
        state = json.dumps(driver_state).encode()
        tmp = manager.temp_dir(self.run_dir, step)
        try:
            self._begin(step, state, plugin_files, tmp, start)
        except (OSError, WorkerError) as exc:
            if out_of_space(exc):
                raise no_space_error(self.run_dir, step, tmp) from None
            raise

    def _begin(
        self, step: int, state: bytes, plugin_files: dict[str, bytes], tmp: str, start: float
    ) -> None:
        roles: dict[str, Any] = {}
        markers: list[tuple[str, int]] = []
        for role, group in self.groups.items():
            role_dir = os.path.join(tmp, role)
            answers = group.call("begin_checkpoint", role_dir, self.background)
            roles[role] = {
                "strategy": self.strategies[role],
                "world_size": group.world_size,
                "dp_size": group.dp_size,
                "layout": answers[0]["layout"],
            }
            markers += [(role_dir, rank) for rank, a in enumerate(answers) if a["background"]]
            if markers and markers[-1][0] == role_dir:
                self._waiting_roles[role] = role_dir
        known = manager.write_driver_files(tmp, state, self.record)
        known.update(contributed.write(tmp, plugin_files))
        self.stats = {"stall_s": time.perf_counter() - start}
        if not markers:
            self._finalize(step, tmp, roles, known, [])
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run_finalizer,
            args=(step, tmp, roles, known, markers),
            name="posttrain-checkpoint-finaliser",
            daemon=True,
        )
        self._thread.start()

    def _run_finalizer(
        self,
        step: int,
        tmp: str,
        roles: dict[str, Any],
        known: dict[str, str],
        markers: list[tuple[str, int]],
    ) -> None:
        try:
            self._finalize(step, tmp, roles, known, markers)
        except BaseException as exc:  # raised on the loop's thread by the next wait()
            self._error = exc

    def _finalize(
        self,
        step: int,
        tmp: str,
        roles: dict[str, Any],
        known: dict[str, str],
        markers: list[tuple[str, int]],
    ) -> None:
        begun = time.perf_counter()
        known = dict(known)
        waiting = list(markers)
        while waiting:
            for role_dir, rank in list(waiting):
                marker = read_marker(role_dir, rank)
                if marker is None:
                    continue
                waiting.remove((role_dir, rank))
                if marker["error"] and out_of_space(marker["error"]):
                    raise no_space_error(self.run_dir, step, tmp)
                if marker["error"]:
                    raise CheckpointError(
                        f"checkpoint {step}: rank {rank} of {os.path.basename(role_dir)} "
                        f"failed to write: {marker['error']}"
                    )
                prefix = os.path.relpath(role_dir, tmp)
                known.update({os.path.join(prefix, r): d for r, d in marker["files"].items()})
            if waiting and self._stop.wait(_POLL_S):
                return  # the run is ending on an error: leave the temporary directory
        for role_dir, rank in markers:
            os.remove(marker_path(role_dir, rank))
        written = time.perf_counter()
        sizes = tree_bytes(tmp)
        path, manifest = manager.finalize_checkpoint(
            self.run_dir, step, tmp, roles, self.versions, self.total_limit, known
        )
        self.stats.update(
            background_s=written - begun, finalize_s=time.perf_counter() - written, bytes=sizes
        )
        self.saved(path, manifest)

    def wait(self) -> None:
        """Block until the save in flight is complete (renamed into place); raise its error."""
        if self._thread is not None:
            if self._thread.is_alive():
                # Ranks finish their writes (and any collective last step) on request.
                for role, role_dir in self._waiting_roles.items():
                    self.groups[role].call("finish_checkpoint", role_dir)
            self._thread.join()
            self._thread = None
        self._waiting_roles = {}
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop waiting for a save without asking the ranks (the run failed): its temporary
        directory stays behind and the next run removes it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
