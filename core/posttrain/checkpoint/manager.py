"""Writes checkpoints atomically (aside, then rename) and finds the latest complete one."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from posttrain.checkpoint.digests import FileDigests
from posttrain.checkpoint.manifest import Manifest, checksum_tree, verify
from posttrain.checkpoint.record import RECORD
from posttrain.errors import CheckpointError
from posttrain.paths import display_path

_NAME = re.compile(r"^checkpoint-(\d+)$")
DRIVER_STATE = "driver_state.json"


def checkpoint_dirs(run_dir: str) -> list[tuple[int, str]]:
    """Finished checkpoint directories (renamed into place), oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def latest_checkpoint(run_dir: str) -> str | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def remove_stale_temporaries(run_dir: str) -> None:
    """Checkpoints a crash left half-written: never renamed into place, so never used."""
    if os.path.isdir(run_dir):
        for name in os.listdir(run_dir):
            if name.startswith(".checkpoint-") and ".tmp" in name:
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir(run_dir: str, step: int) -> str:
    """A fresh temporary directory for the checkpoint of ``step``: invisible to resume."""
    tmp = os.path.join(run_dir, f".checkpoint-{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def write_driver_files(tmp: str, driver_state: bytes, record: bytes) -> dict[str, str]:
    """The driver's state (serialised when the save began) and the run's workflow record
    (:mod:`posttrain.checkpoint.record`), hashed while written."""
    digests = FileDigests(tmp)
    for name, content in ((DRIVER_STATE, driver_state), (RECORD, record)):
        with digests.open(os.path.join(tmp, name)) as f:
            f.write(content)
    return digests.relative()


def finalize_checkpoint(
    run_dir: str,
    step: int,
    tmp: str,
    roles: dict[str, Any],
    versions: dict[str, str],
    total_limit: int | None = None,
    known: dict[str, str] | None = None,
) -> tuple[str, Manifest]:
    """Once every file under ``tmp`` is complete: the manifest (checksums from ``known``, those
    computed while writing; any other file is read here), then the rename into place, then the
    removal of checkpoints beyond ``total_limit``. A crash before the rename leaves only a
    temporary directory, which resume ignores and removes."""
    manifest = Manifest(step=step, roles=roles, versions=versions, files=checksum_tree(tmp, known))
    manifest.write(tmp)  # last: a directory without it is never complete
    _fsync_dir(tmp)
    final = os.path.join(run_dir, f"checkpoint-{step}")
    if os.path.exists(final):  # re-saving a step (after a resume): swap, never leave a gap
        old = os.path.join(run_dir, f".checkpoint-{step}.tmp-old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(run_dir)
    if total_limit:
        for old_step, path in checkpoint_dirs(run_dir)[:-total_limit]:
            # Out of sight first: a crash during the removal must not leave a directory that
            # looks complete (its manifest present) while its files are half deleted.
            doomed = os.path.join(run_dir, f".checkpoint-{old_step}.tmp-old")
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        _fsync_dir(run_dir)
    return final, manifest


def save_checkpoint(
    run_dir: str,
    step: int,
    save_roles: Callable[[str], dict[str, Any]],
    driver_state: dict[str, Any],
    versions: dict[str, str],
    total_limit: int | None = None,
    record: bytes = b"",
) -> str:
    """A synchronous save: ``save_roles(tmp_dir)`` writes every role's part and returns their
    layouts; the files it wrote are checksummed by reading them back."""
    tmp = temp_dir(run_dir, step)
    roles = save_roles(tmp)
    known = write_driver_files(tmp, json.dumps(driver_state).encode(), record)
    return finalize_checkpoint(run_dir, step, tmp, roles, versions, total_limit, known)[0]


def load_driver_state(checkpoint_dir: str) -> tuple[Manifest, dict[str, Any]]:
    manifest = verify(checkpoint_dir)
    path = os.path.join(checkpoint_dir, DRIVER_STATE)
    try:
        with open(path, encoding="utf-8") as f:
            return manifest, json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{display_path(path)} cannot be read ({exc})") from None
