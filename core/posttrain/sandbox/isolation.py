"""Which isolation this machine offers a sandboxed run, found out by trying it (cached per
process), and the guarantees each level gives.

Two levels, both built from well-kept tools rather than a jail of our own:

* ``bubblewrap``: ``bwrap`` puts the run in new user, PID, network, IPC, UTS and mount
  namespaces whose file system is read-only but for two bounded tmpfs (``/tmp`` and the
  working directory), and holds only ``/usr``, a fresh ``/proc`` and a minimal ``/dev``.
  ``--die-with-parent`` and the PID namespace end every process of the run when it returns or
  is killed. util-linux's ``prlimit`` sets the
  rlimits; the process-count limit is set inside the run's own user namespace, so it counts the
  run's processes only.
* ``rlimits``: the same rlimits, a clean environment, no inherited descriptors, a temporary
  working directory and a process group of its own, but the run sees the machine's files and
  network, and a child that starts a session of its own escapes the kill of the group.

Running as root, the run's processes run as ``nobody``: the kernel does not apply the
process-count limit to root, and ``nobody`` cannot signal the caller or write its files.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from collections.abc import Iterable

# The sandbox user when the caller is root: the kernel exempts uid 0 from RLIMIT_NPROC.
NOBODY = 65534
LEVELS = ("bubblewrap", "rlimits")
NOT_INSTALLED = "bwrap is not installed"


@attrs.frozen(kw_only=True)
class Guarantee:
    name: str
    holds: bool
    how: str


@attrs.frozen(kw_only=True)
class Isolation:
    """What this machine offers: the best level, why bubblewrap is missing if it is, and the
    guarantees of each level."""

    bubblewrap: bool
    bubblewrap_problem: str  # "" when bubblewrap works
    prlimit: str | None  # path of util-linux's prlimit

    @property
    def best(self) -> str:
        return "bubblewrap" if self.bubblewrap else "rlimits"

    @property
    def remedy(self) -> str:
        """What would make bubblewrap run here ("" where it does)."""
        if self.bubblewrap:
            return ""
        if self.bubblewrap_problem == NOT_INSTALLED:
            return "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"
        return "let bubblewrap make user namespaces here (docs/sandbox.md)"

    def guarantees(self, level: str) -> list[Guarantee]:
        """The guarantees a run at ``level`` has on this machine."""
        caged = level == "bubblewrap" and self.bubblewrap
        root = os.geteuid() == 0
        return [
            Guarantee(name="wall-clock limit", holds=True, how="the caller kills the run"),
            Guarantee(name="CPU-time limit", holds=True, how="RLIMIT_CPU"),
            Guarantee(name="address-space limit", holds=True, how="RLIMIT_AS"),
            Guarantee(name="file-size limit", holds=True, how="RLIMIT_FSIZE"),
            Guarantee(
                name="process-count limit",
                holds=caged or root,
                how="RLIMIT_NPROC in the run's own user namespace"
                if caged
                else "RLIMIT_NPROC of user nobody, shared by runs side by side"
                if root
                else "no: RLIMIT_NPROC counts every process of the caller's user (a fork bomb "
                "stops, but a busy user may see the run refused forks)",
            ),
            Guarantee(
                name="no inherited environment or descriptors",
                holds=True,
                how="a fixed small environment, descriptors closed",
            ),
            Guarantee(
                name="no network",
                holds=caged,
                how="network namespace with loopback only" if caged else "no: needs bubblewrap",
            ),
            Guarantee(
                name="no view of the caller's files",
                holds=caged,
                how="mount namespace: /usr read-only and tmpfs"
                if caged
                else "no: needs bubblewrap (as nobody, files others cannot read stay hidden)"
                if root
                else "no: needs bubblewrap",
            ),
            Guarantee(
                name="every process gone on return",
                holds=caged,
                how="PID namespace, --die-with-parent"
                if caged
                else "no: the process group is killed, but a child with a session of its own "
                "escapes it; needs bubblewrap",
            ),
            Guarantee(
                name="cannot signal the caller",
                holds=caged or root,
                how="PID namespace" if caged else "runs as nobody" if root else "no",
            ),
        ]


def sandbox_user() -> int | None:
    """The uid (and gid) the run's processes take; None: the caller's own."""
    return NOBODY if os.geteuid() == 0 else None


def interpreter_prefix(python: str) -> str | None:
    """The folder an interpreter outside /usr lives in (pyenv, conda): shown to the run
    read-only, since the interpreter needs its standard library. None for /usr's own."""
    real = os.path.realpath(python)
    return None if real.startswith("/usr/") else os.path.dirname(os.path.dirname(real))


def hidden_from_sandbox_user(paths: Iterable[str]) -> list[str]:
    """Problems with paths the run's processes must read, when they run as nobody: each path
    and every folder above it must let others through (bwrap, run as nobody, opens them)."""
    if sandbox_user() is None:  # the caller's own user runs the sandbox
        return []
    problems = []
    for path in paths:
        if not os.path.exists(path):
            problems.append(f"{path} does not exist")
            continue
        here = os.path.abspath(path)
        while True:
            mode = os.stat(here).st_mode
            need = stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
            if not mode & need:
                problems.append(
                    f"{path}: the sandbox runs as nobody, which cannot "
                    f"{'enter' if need == stat.S_IXOTH else 'read'} {here}"
                )
                break
            if here == "/":
                break
            here = os.path.dirname(here)
    return problems


def system_dirs() -> list[str]:
    """bwrap arguments that show the machine's programs and libraries, read-only: ``/usr``, and
    ``/bin``, ``/lib``... as the symlinks (merged /usr) or directories the machine has."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


@functools.cache
def detect() -> Isolation:
    """Try bubblewrap once (as the sandbox user, with the namespaces a run uses)."""
    prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    bwrap = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if bwrap is None:
        return Isolation(
            bubblewrap=False,
            bubblewrap_problem=NOT_INSTALLED,
            prlimit=prlimit,
        )
    uid = sandbox_user()
    probe = [bwrap, "--die-with-parent", "--unshare-all", *system_dirs(), "--", "/bin/true"]
    try:
        done = subprocess.run(
            probe,
            capture_output=True,
            text=True,
            timeout=10,
            env={},
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Isolation(bubblewrap=False, bubblewrap_problem=str(exc), prlimit=prlimit)
    if done.returncode != 0:
        problem = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        return Isolation(
            bubblewrap=False,
            bubblewrap_problem=f"{problem} (user namespaces may be disabled here)",
            prlimit=prlimit,
        )
    return Isolation(bubblewrap=True, bubblewrap_problem="", prlimit=prlimit)
