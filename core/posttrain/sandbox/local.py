"""Run one Python program in the local sandbox (see :mod:`posttrain.sandbox.isolation`).

Each run gets a fresh temporary directory holding the program, a fresh process (a session of its
own, a fixed small environment, stdin from /dev/null, no other descriptors), rlimits set by
``prlimit``, and under bubblewrap its namespaces. The caller reads at most ``max_output_bytes``
of each stream and drops the rest, so a program that prints without end costs no memory. At the
wall-clock limit, or as soon as the program ends, every process left in its group is killed
(under bubblewrap the PID namespace has ended them all already).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from posttrain.errors import UserError
from posttrain.sandbox import isolation as iso
from posttrain.sandbox.result import KilledReason, SandboxLimits, SandboxResult

if TYPE_CHECKING:
    from collections.abc import Iterable

# The whole environment of a run. One thread per math library: their pools start a thread per
# core, and threads count against the process-count limit.
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_WORKDIR = "/sandbox"  # the working directory inside bubblewrap
_CODE = "/code/main.py"  # the program inside bubblewrap (read-only)
# After the program ends, how long output still in the pipes is read before they are closed.
_DRAIN_S = 0.5


class SandboxUnavailable(UserError):
    """The isolation a run asks for cannot be had on this machine."""


def resolve_level(requested: str) -> str:
    """The level a run gets: ``auto`` -> the best here; ``strict`` (or ``bubblewrap``) ->
    ``bubblewrap``, an error where it cannot run; ``rlimits`` -> ``rlimits``."""
    found = iso.detect()
    if found.prlimit is None:
        raise SandboxUnavailable(
            "the sandbox needs util-linux's prlimit, which is not installed "
            "(Debian/Ubuntu: apt-get install util-linux)"
        )
    if requested == "auto":
        return found.best
    if requested in ("strict", "bubblewrap"):
        if not found.bubblewrap:
            raise SandboxUnavailable(
                f"isolation '{requested}' needs bubblewrap, which cannot run here: "
                f"{found.bubblewrap_problem}; {found.remedy}, or accept weaker isolation with "
                "isolation: auto or rlimits (docs/sandbox.md)"
            )
        return "bubblewrap"
    return requested


def fallback_warning(requested: str, level: str) -> str:
    """The one line saying what is not contained when ``auto`` fell back to rlimits ("" for
    any other outcome: a level asked for by name is the user's informed choice)."""
    if requested != "auto" or level != "rlimits":
        return ""
    found = iso.detect()
    return (
        f"warning: the sandbox runs without bubblewrap ({found.bubblewrap_problem}), so the "
        "code it runs is not contained: it can use the network, read and write this machine's "
        f"files, and leave processes running after the call; {found.remedy}, or set isolation: "
        "strict to refuse to run without it (docs/sandbox.md)"
    )


@functools.cache
def warn_fallback_once(requested: str, level: str) -> None:
    """:func:`fallback_warning` on stderr, once per process (an environment's config is made
    more than once in a run: when the workflow is validated and when the instances are)."""
    text = fallback_warning(requested, level)
    if text:
        print(text, file=sys.stderr, flush=True)


def check_paths(python: str, read_only_paths: Iterable[str], level: str) -> list[str]:
    """What keeps the interpreter or the read-only paths from the run, one line each."""
    if not os.path.isfile(python):
        return [f"the sandbox's interpreter {python} does not exist"]
    shown = [python, os.path.realpath(python), *read_only_paths]
    if level == "bubblewrap":
        prefix = iso.interpreter_prefix(python)
        shown += [prefix] if prefix else []
    return iso.hidden_from_sandbox_user(shown)


def _rlimit_args(limits: SandboxLimits, nproc: bool) -> list[str]:
    cpu = limits.cpu_seconds
    args = [
        f"--as={limits.memory_mb * 2**20}",
        # The soft limit sends SIGXCPU, the hard one a second later SIGKILL.
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.max_file_mb * 2**20}",
        "--core=0",
        "--nofile=256",
    ]
    return args + ([f"--nproc={limits.max_processes}"] if nproc else [])


def _command(
    level: str, limits: SandboxLimits, python: str, workdir: str, extra_ro: Iterable[str]
) -> list[str]:
    prlimit = iso.detect().prlimit
    # resolve_level has refused a sandbox without prlimit, and bubblewrap without bwrap.
    assert prlimit is not None
    program = [python, "-E", "-s"]
    if level == "rlimits":
        return [prlimit, *_rlimit_args(limits, nproc=True), "--", *program, "main.py"]
    bwrap = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    assert bwrap is not None
    binds = []
    prefix = iso.interpreter_prefix(python)
    if prefix is not None:
        binds += ["--ro-bind", prefix, prefix]
    for path in extra_ro:
        binds += ["--ro-bind", path, path]
    env = [a for key, value in {**_ENV, "HOME": _WORKDIR}.items() for a in ("--setenv", key, value)]
    # The user namespace is made by bwrap under the outer (high) process-count limit; the run's
    # own limit is set inside it, where the kernel counts the run's processes only.
    return [
        prlimit, *_rlimit_args(limits, nproc=False), "--",
        bwrap,
        "--die-with-parent", "--unshare-all", "--new-session", "--clearenv", *env,
        *iso.system_dirs(), *binds,
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.workdir_mb * 2**20), "--tmpfs", "/tmp",
        "--size", str(limits.workdir_mb * 2**20), "--tmpfs", _WORKDIR,
        "--ro-bind", os.path.join(workdir, "main.py"), _CODE,
        # A tmpfs holds its files in the host's memory: the two above are bounded, and the
        # file system's root and /dev (where bwrap made the mount points and device nodes) are
        # made read-only, so no other tmpfs can be filled.
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--chdir", _WORKDIR,
        "--", prlimit, f"--nproc={limits.max_processes}", "--", *program, _CODE,
    ]  # fmt: skip


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    isolation: str = "auto",
    python: str = "/usr/bin/python3",
    read_only_paths: tuple[str, ...] = (),
) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; the result whatever the program did.
    :class:`SandboxUnavailable` when the isolation asked for cannot be had here."""
    limits = limits if limits is not None else SandboxLimits()
    level = resolve_level(isolation)
    problems = check_paths(python, read_only_paths, level)
    if problems:
        raise SandboxUnavailable("; ".join(problems))
    uid = iso.sandbox_user()
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as file:
            file.write(code)
        if uid is not None:  # the run's user reads the program and, without bubblewrap, writes here
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "main.py"), uid, uid)
        command = _command(level, limits, python, workdir, read_only_paths)
        return _run(command, level, limits, workdir, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(
    command: list[str], level: str, limits: SandboxLimits, workdir: str, uid: int | None
) -> SandboxResult:
    try:
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env={**_ENV, "HOME": workdir},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
    except OSError as exc:  # e.g. EAGAIN: nobody's process-count limit, shared without bwrap
        raise SandboxUnavailable(f"the sandbox could not start its process: {exc}") from None
    # Popen made both pipes (stdout=PIPE, stderr=PIPE): the narrowing is for the type checker.
    assert process.stdout is not None and process.stderr is not None
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    dropped = {"stdout": False, "stderr": False}
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    deadline = time.monotonic() + limits.timeout_s
    # Once the program has ended: how long what is still in the pipes is read.
    drain_until = math.inf
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if drain_until == math.inf and process.poll() is not None:
                _kill_group(process)  # what the program left behind, if anything
                drain_until = now + _DRAIN_S
            if drain_until != math.inf and (not selector.get_map() or now >= drain_until):
                break
            if drain_until == math.inf and now >= deadline:
                timed_out = True
                break
            wait = min(deadline, drain_until, now + 0.05) - now
            if not selector.get_map():  # the program closed its output and runs on
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=wait)
                continue
            for key, _ in selector.select(timeout=wait):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                room = limits.max_output_bytes - len(kept[key.data])
                kept[key.data] += chunk[: max(0, room)]
                dropped[key.data] |= len(chunk) > room
    finally:
        returncode = _end(process, level)
        selector.close()
        process.stdout.close()
        process.stderr.close()
    stdout = kept["stdout"].decode("utf-8", errors="replace")
    stderr = kept["stderr"].decode("utf-8", errors="replace")
    # bwrap reports a program ended by signal N as exit status 128 + N.
    if level == "bubblewrap" and returncode > 128:
        returncode = -(returncode - 128)
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=returncode,
        timed_out=timed_out,
        killed_reason="timeout" if timed_out else _reason(returncode, stderr),
        stdout_truncated=dropped["stdout"],
        stderr_truncated=dropped["stderr"],
        isolation=level,
    )


def _end(process: subprocess.Popen, level: str) -> int:
    """Kill what is left of the run and wait until it is gone; the exit status.

    Under bubblewrap the PID namespace's first process is killed, not bwrap: the kernel then
    kills every process of the namespace before that one is gone, and bwrap, which waits for
    it, exits after them. Killing bwrap instead would leave the namespace to die on its own
    time, after the call had returned."""
    if level == "bubblewrap" and process.poll() is None:
        namespace_init = _children(process.pid)
        for pid in namespace_init:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signal.SIGKILL)
        if namespace_init:  # bwrap itself stuck past 5 s: the group kill below ends it
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
    _kill_group(process)
    return process.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:  # bwrap ended meanwhile
        return []


def _kill_group(process: subprocess.Popen) -> None:
    # ProcessLookupError: the group is empty (and its leader reaped).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _reason(returncode: int, stderr: str) -> KilledReason:
    """What limit ended the program, read from how it ended. Python raises MemoryError when the
    address-space limit refuses an allocation and OSError EFBIG past the file-size limit (it
    ignores SIGXFSZ); either, uncaught, is the last line of its traceback."""
    if returncode == 0:
        return None
    if returncode == -signal.SIGXCPU:
        return "cpu"
    if returncode == -signal.SIGXFSZ:
        return "file_size"
    if returncode < 0:
        return "signal"
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if last.startswith("MemoryError"):
        return "memory"
    if "[Errno 27]" in last:  # EFBIG: File too large
        return "file_size"
    return None
