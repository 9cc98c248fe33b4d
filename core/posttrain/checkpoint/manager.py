"""Writes checkpoints atomically (aside, then rename) and finds the latest complete one."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from posttrain.checkpoint.manifest import Manifest, checksum_tree, verify
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


def save_checkpoint(
    run_dir: str,
    step: int,
    save_roles: Callable[[str], dict[str, Any]],
    driver_state: dict[str, Any],
    versions: dict[str, str],
    total_limit: int | None = None,
) -> str:
    """``save_roles(tmp_dir)`` writes every role's part and returns their layouts."""
    final = os.path.join(run_dir, f"checkpoint-{step}")
    tmp = os.path.join(run_dir, f".checkpoint-{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    roles = save_roles(tmp)
    with open(os.path.join(tmp, DRIVER_STATE), "w", encoding="utf-8") as f:
        json.dump(driver_state, f)
        f.flush()
        os.fsync(f.fileno())
    manifest = Manifest(step=step, roles=roles, versions=versions, files=checksum_tree(tmp))
    manifest.write(tmp)  # last: a directory without it is never complete
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving a step (after a resume): swap, never leave a gap
        old = os.path.join(run_dir, f".checkpoint-{step}.tmp-old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(run_dir)
    if total_limit:
        for _, path in checkpoint_dirs(run_dir)[:-total_limit]:
            shutil.rmtree(path, ignore_errors=True)
    return final


def load_driver_state(checkpoint_dir: str) -> tuple[Manifest, dict[str, Any]]:
    manifest = verify(checkpoint_dir)
    path = os.path.join(checkpoint_dir, DRIVER_STATE)
    try:
        with open(path, encoding="utf-8") as f:
            return manifest, json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{display_path(path)} cannot be read ({exc})") from None
