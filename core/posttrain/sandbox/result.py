"""What a sandboxed run is given (its limits) and what it answers (its result)."""

from __future__ import annotations

import math
from typing import Literal

import attrs

from posttrain.config.ranges import at_least, between

# Why the sandbox ended the program, or what limit it ran into; None: it ended by itself.
KilledReason = Literal["timeout", "cpu", "memory", "file_size", "signal"] | None


@attrs.frozen(kw_only=True)
class SandboxLimits:
    """The limits of one run. Each is enforced by the kernel (rlimits) or by the caller (the
    wall clock, the output it keeps); docs/sandbox.md says which hold where."""

    # Wall-clock seconds before every process of the run is killed.
    timeout_s: float = attrs.field(default=10.0, validator=between(0, 3600, low_open=True))
    # CPU seconds of each process (RLIMIT_CPU): a busy loop ends even while the caller stalls.
    # null: timeout_s, rounded up.
    cpu_time_s: int | None = attrs.field(default=None, validator=at_least(1))
    # Address space of each process, in MiB (RLIMIT_AS): allocations beyond it fail.
    memory_mb: int = attrs.field(default=1024, validator=at_least(64))
    # Processes (and threads) the run may have at once (RLIMIT_NPROC, per run under bubblewrap).
    max_processes: int = attrs.field(default=32, validator=at_least(2))
    # Largest file the run may write, in MiB (RLIMIT_FSIZE).
    max_file_mb: int = attrs.field(default=16, validator=at_least(1))
    # Size of the working directory and of /tmp, each a tmpfs under bubblewrap (in MiB, all
    # files together; held in memory); without bubblewrap the working directory is a folder on
    # the host's disk, bounded by max_file_mb per file only.
    workdir_mb: int = attrs.field(default=64, validator=at_least(1))
    # Bytes of stdout and of stderr kept; the rest is read and dropped (reported as truncated).
    max_output_bytes: int = attrs.field(default=65536, validator=at_least(1))

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_time_s if self.cpu_time_s is not None else math.ceil(self.timeout_s)


@attrs.frozen(kw_only=True)
class SandboxResult:
    stdout: str
    stderr: str
    # The program's exit status; -N when a signal N ended it; None when it never ran to an end
    # the sandbox could see (a remote sandbox's error).
    exit_code: int | None
    timed_out: bool = False
    killed_reason: KilledReason = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    # How the run was isolated: "bubblewrap", "rlimits" or "remote".
    isolation: str = ""

    def to_json(self) -> dict:
        return attrs.asdict(self)


def truncate(text: str, limit: int, marker: str = "...[truncated]") -> str:
    """``text`` cut to ``limit`` characters, saying so when cut."""
    if len(text) <= limit:
        return text
    return text[: max(0, limit - len(marker))] + marker
