"""Files an SGLang engine leaves behind, and their removal after it shut down.

SGLang stops its scheduler and detokenizer with SIGKILL (``kill_process_tree``), which skips every
unlink: the engine leaves ``/dev/shm/sglang_loads_*`` (load-snapshot slots), ``/dev/shm/sem.mp-*``
(multiprocessing semaphores whose resource tracker was killed with the tree) and its ZeroMQ IPC
socket files under the temp directory. Other programs on the machine create ``sem.mp-*`` files
too, so only files that appeared while the engine lived *and* that no other live process maps
are removed. (The rank that drove the engine still maps some of the semaphores itself: unlinking
them is safe, as for an open file, since nothing opens them by name once the engine is gone.)
Never remove such files by name pattern alone: a live program may still hand its semaphores to
new child processes by name.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine

log = logging.getLogger("posttrain.sglang")

SHM_DIR = "/dev/shm"
SHM_PREFIXES = ("sglang_loads_", "sem.mp-")
# ServerArgs' PortArgs fields that name ``ipc://`` files made with NamedTemporaryFile.
IPC_FIELDS = (
    "tokenizer_ipc_name",
    "scheduler_input_ipc_name",
    "detokenizer_ipc_name",
    "rpc_ipc_name",
    "metrics_ipc_name",
    "tokenizer_worker_ipc_name",
)


def shm_snapshot() -> set[str]:
    """The engine-kind files in ``/dev/shm`` now (taken before an engine starts)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIXES)}
    except OSError:
        return set()


def mapped_inodes(exclude_pid: int | None = None) -> set[int]:
    """Inodes of /dev/shm files that some live process (other than ``exclude_pid``) maps.

    Named semaphores and shm segments are mmapped by every process that uses them. The path in
    /proc/PID/maps is no help for semaphores (glibc creates them under a temporary name, then
    links it: the mapping shows ``/dev/shm/sem.XXXXXX (deleted)``), the inode is."""
    inodes: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == exclude_pid:
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(SHM_DIR + "/"):
                        inodes.add(int(fields[4]))
        except (OSError, ValueError):  # the process exited, or is not ours to read
            continue
    return inodes


def in_use(name: str, inodes: set[int]) -> bool:
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino in inodes
    except FileNotFoundError:
        return False


def remove_shm_leftovers(before: set[str]) -> list[str]:
    """Remove engine-kind files created since ``before`` that no other process maps."""
    new = shm_snapshot() - before
    if not new:
        return []
    inodes = mapped_inodes(exclude_pid=os.getpid())
    removed = []
    for name in sorted(new):
        if in_use(name, inodes):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            os.remove(path)
            removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
    if removed:
        log.info("removed the engine's leftovers in %s: %s", SHM_DIR, ", ".join(removed))
    return removed


def ipc_paths(engine: Engine) -> list[str]:
    """The files behind the engine's ``ipc://`` ZeroMQ endpoints."""
    port_args = getattr(engine, "port_args", None)
    names = [getattr(port_args, field, None) for field in IPC_FIELDS]
    return [n.removeprefix("ipc://") for n in names if n and n.startswith("ipc://")]


def remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
