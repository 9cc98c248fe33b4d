"""Python stacks of live processes, taken from outside: the hang watchdog and ``posttrain stacks``.

Each rank process (and the driver) registers :mod:`faulthandler` on ``SIGUSR1`` at start-up,
writing into a file of its own beside its log (``RUN_DIR/logs/<roles>.rank<r>.stacks``).
faulthandler dumps from the signal handler itself, in C, without the GIL: it answers while the
process's main thread is blocked inside a collective or any other C++ call, where a Python-level
side channel would wait. The process that wants the stacks records each file's size, signals the
processes and reads what each appended.

The driver lists the processes a run started in ``RUN_DIR/logs/processes.json`` (pid, start time,
roles, rank, node, stacks file) while they live, so another terminal can ask too. A pid is
signalled only if the process under it started when the listed one did: a recycled pid is
never sent a signal its owner would die of.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import socket
import threading
import time

import attrs

DUMP_SIGNAL = signal.SIGUSR1
PROCESSES_FILE = "processes.json"
_MAIN_THREAD_HEADER = "posttrain main thread: "
_REPORTERS = ("stacks.py", "hang_watch.py")
_registered: dict[str, object] = {}  # the open stacks file of this process (kept open)


@attrs.frozen(kw_only=True)
class StackTarget:
    """A process whose stacks can be asked for."""

    label: str  # e.g. "actor_train+actor_infer rank 1", "driver"
    pid: int
    start_time: str  # /proc/PID/stat's start time: the process's identity with its pid
    node: str
    stacks_path: str


def stacks_path_for(log_path: str) -> str:
    """A process's stacks file, beside its log."""
    return log_path.removesuffix(".log") + ".stacks"


def install_stack_dump(path: str) -> None:
    """Let this process dump every thread's Python stack into ``path`` on ``SIGUSR1``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the process)
    f.write(f"{_MAIN_THREAD_HEADER}0x{threading.main_thread().ident:016x}\n")
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    _registered["file"] = f


def process_start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or ""
    where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def this_node() -> str:
    return socket.gethostname()


def target(label: str, pid: int, node: str, stacks_path: str) -> StackTarget:
    return StackTarget(
        label=label,
        pid=pid,
        start_time=process_start_time(pid),
        node=node,
        stacks_path=stacks_path,
    )


def write_processes(run_dir: str, targets: list[StackTarget]) -> None:
    """List the run's live processes for ``posttrain stacks`` (atomically)."""
    path = os.path.join(run_dir, "logs", PROCESSES_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump([attrs.asdict(t) for t in targets], f, indent=1)
    os.replace(tmp, path)


def read_processes(run_dir: str) -> list[StackTarget]:
    path = os.path.join(run_dir, "logs", PROCESSES_FILE)
    with open(path, encoding="utf-8") as f:
        return [StackTarget(**item) for item in json.load(f)]


def remove_processes(run_dir: str) -> None:
    path = os.path.join(run_dir, "logs", PROCESSES_FILE)
    if os.path.exists(path):
        os.remove(path)


def collect_stacks(targets: list[StackTarget], wait_s: float = 5.0) -> dict[str, str]:
    """Each target's stacks (every thread's, as faulthandler prints them), by label; a target
    that cannot be asked (another node, gone, no answer) gets a line that says why."""
    here = this_node()
    sizes: dict[str, int] = {}
    out: dict[str, str] = {}
    for t in targets:
        if t.node != here:
            out[t.label] = f"(on node {t.node}: stacks are taken on this node only)\n"
        elif process_start_time(t.pid) != t.start_time or not t.start_time:
            out[t.label] = f"(process {t.pid} has exited)\n"
        else:
            sizes[t.label] = _size(t.stacks_path)
            try:
                os.kill(t.pid, DUMP_SIGNAL)
            except OSError as exc:
                out[t.label] = f"(process {t.pid} could not be signalled: {exc})\n"
                sizes.pop(t.label)
    by_label = {t.label: t for t in targets}
    deadline = time.monotonic() + wait_s
    waiting = dict(sizes)
    last_seen: dict[str, tuple[int, float]] = {}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        for label, before in list(waiting.items()):
            size = _size(by_label[label].stacks_path)
            seen = last_seen.get(label)
            # Done once the file grew and stayed the same size for a moment (a dump is a burst).
            if size > before and seen and seen[0] == size and time.monotonic() - seen[1] > 0.2:
                out[label] = _read_from(by_label[label].stacks_path, before)
                del waiting[label]
            elif not seen or seen[0] != size:
                last_seen[label] = (size, time.monotonic())
    for label, before in waiting.items():
        text = _read_from(by_label[label].stacks_path, before)
        out[label] = text or f"(no answer from process {by_label[label].pid} in {wait_s:.0f}s)\n"
    return {t.label: out[t.label] for t in targets}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        return f.read()


# -- reading a dump --------------------------------------------------------------------------

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)


@attrs.frozen
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({os.path.basename(self.file)}:{self.line})"


def main_thread_frames(dump: str, stacks_file_head: str = "") -> list[Frame]:
    """The main thread's frames in a faulthandler dump, innermost first. The thread is known by
    the ident its process wrote at the top of its stacks file (else: the dump's first thread)."""
    ident = None
    head = re.search(re.escape(_MAIN_THREAD_HEADER) + r"(0x[0-9a-f]+)", stacks_file_head)
    if head:
        ident = head.group(1)
    blocks = list(_THREAD.finditer(dump))
    for i, match in enumerate(blocks):
        end = blocks[i + 1].start() if i + 1 < len(blocks) else len(dump)
        if ident is None or match.group(1) == ident:
            body = dump[match.end() : end]
            return [Frame(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(body)]
    return []


def _is_torch_distributed(frame: Frame) -> bool:
    return f"torch{os.sep}distributed{os.sep}" in frame.file


def _is_library(frame: Frame) -> bool:
    parts = frame.file.split(os.sep)
    return ("site-packages" in parts or "dist-packages" in parts) and not any(
        p.startswith("posttrain") for p in parts
    )


def describe(frames: list[Frame]) -> str:
    """Where a main thread is, in one line: its innermost frame of the run's own code (posttrain,
    its plugins, the workflow's modules) and, when it waits in torch.distributed, the
    collective."""
    # The reporting code's own frames (the driver, while it asks) say nothing about a hang.
    frames = [f for f in frames if os.path.basename(f.file) not in _REPORTERS] or frames
    if not frames:
        return "no Python frame (the process is starting or ending)"
    own = next((f for f in frames if not _is_library(f) and "/lib/python" not in f.file), None)
    collective = next((f for f in frames if _is_torch_distributed(f)), None)
    parts = []
    if collective is not None:
        outer = _outermost_distributed(frames, collective)
        parts.append(f"waiting in torch.distributed {outer.func} ({_short(outer.file)})")
    where = own or frames[0]
    parts.append(f"in {where}")
    if frames[0] is not where and collective is None:
        parts.append(f"innermost {frames[0]}")
    return ", ".join(parts)


def _outermost_distributed(frames: list[Frame], first: Frame) -> Frame:
    """Of the run of torch.distributed frames that starts at ``first`` (innermost), the
    outermost with a public name: the collective the caller asked for (all_gather, all_reduce,
    barrier), not a decorator's wrapper or a helper inside it."""
    start = frames.index(first)
    outer = first
    for f in frames[start:]:
        if not _is_torch_distributed(f):
            break
        if is_public_call(f.func):
            outer = f
    return outer


def is_public_call(name: str) -> bool:
    """A torch.distributed function a caller asks for by name (all_reduce, barrier), not a
    decorator's wrapper or a private helper inside it."""
    return name != "wrapper" and not name.startswith("_")


def _short(path: str) -> str:
    marker = f"torch{os.sep}distributed{os.sep}"
    return path[path.index(marker) :] if marker in path else os.path.basename(path)


def where(dump: str, head: str) -> tuple[list[Frame], str]:
    """A process's main-thread frames in ``dump`` and the line that says where it is (or, when
    there was no dump, why)."""
    frames = main_thread_frames(dump, head)
    return frames, describe(frames) if frames else dump.strip()


def summary_lines(dumps: dict[str, str], heads: dict[str, str]) -> list[str]:
    return [f"{label}: {where(dump, heads.get(label, ''))[1]}" for label, dump in dumps.items()]


def file_head(path: str) -> str:
    """The first line of a stacks file (the main thread's ident)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline()
    except OSError:
        return ""


def format_frames(frames: list[Frame]) -> list[str]:
    """A main thread's frames, outermost first (as a Python traceback reads)."""
    return [f'  File "{f.file}", line {f.line} in {f.func}' for f in reversed(frames)]


def live_run_stacks(run_dir: str, all_threads: bool = False) -> str:
    """``posttrain stacks``: every process of the live run in ``run_dir``, each with where its
    main thread is (one line) and its main thread's stack (or every thread's)."""
    from posttrain.errors import UserError

    try:
        targets = read_processes(run_dir)
    except FileNotFoundError:
        raise UserError(
            f"no live run in {run_dir}: its processes are listed in "
            f"logs/{PROCESSES_FILE} only while they run"
        ) from None
    dumps = collect_stacks(targets)
    out = []
    for t in targets:
        dump = dumps[t.label]
        frames, line = where(dump, file_head(t.stacks_path))
        out.append(f"== {t.label} (pid {t.pid}, node {t.node}): {line}")
        if all_threads and frames:
            out.append(dump.rstrip())
        elif frames:
            out.extend(format_frames(frames))
    return "\n".join(out)
