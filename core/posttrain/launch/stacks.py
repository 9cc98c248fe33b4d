"""Python stacks of live processes, taken from outside: the hang watchdog and ``posttrain stacks``.

Each rank process (and the driver) starts a daemon thread at start-up that answers on a Unix
socket of its own (an abstract address named after the process's pid and start time): whoever
connects gets every other thread's stack, which the thread has :func:`faulthandler.dump_traceback`
write while it holds the GIL. Frames only change under the GIL, so they are read while no thread
can push or pop one, or end. The thread answers while the main thread is blocked in a
collective or any other C++ call that releases the GIL, as torch's do.

Only a process that does not answer in ``ANSWER_S`` (its GIL held by a thread stuck in C) is
asked the old way: :mod:`faulthandler`, registered on ``SIGUSR1``, dumps every thread into a
file beside the process's log (``RUN_DIR/logs/<roles>.rank<r>.stacks``) from the signal handler.
That dump reads other threads' frames without the GIL: a thread that returns from a deep call
(freeing a chunk of its frame stack) or ends while it is read makes it read freed memory, and
the process dies of SIGSEGV (issue 44: the driver of a live run did, asked by ``posttrain
stacks``). With the GIL held by a stuck thread, no other thread can change its frames, which is
when the fallback is used; its output says so.

The driver lists the processes a run started in ``RUN_DIR/logs/processes.json`` (pid, start time,
roles, rank, node, stacks file) while they live, so another terminal can ask too. A pid is
signalled only if the process under it started when the listed one did, and has registered the
handler (its stacks file says so): a recycled pid, or a process still starting, is never sent a
signal it would die of.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import selectors
import signal
import socket
import struct
import threading
import time

import attrs

DUMP_SIGNAL = signal.SIGUSR1
# How long a process gets to answer from its own thread before faulthandler is asked instead.
ANSWER_S = 2.0
PROCESSES_FILE = "processes.json"
_MAIN_THREAD_HEADER = "posttrain main thread: "
_END_OF_ANSWER = "-- end of stacks --\n"  # an answer without it was cut short
_FALLBACK_NOTE = "(faulthandler's dump: the process did not answer from its own thread in {}s)\n"
_SERVER_THREAD = "posttrain-stacks"
_REPORTERS = ("stacks.py", "hang_watch.py")
# A thread's first line and a frame's, in faulthandler's dumps (and in the answers, which use
# its format).
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
# This process's open stacks file (kept open for faulthandler) and its stacks socket.
_registered: dict[str, object] = {}


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
    """Let this process answer for every thread's Python stack: from a thread of its own, on
    its socket, and, as a fallback, by faulthandler into ``path`` on ``SIGUSR1``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the process)
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    # Written once the handler is registered: a file that names the main thread is a process
    # that SIGUSR1 does not kill.
    f.write(f"{_MAIN_THREAD_HEADER}0x{threading.main_thread().ident:016x}\n")
    _registered["file"] = f
    if "server" not in _registered:  # once per process (a driver may start several runs)
        _registered["server"] = _start_stack_server()


def _address(pid: int, start_time: str) -> bytes:
    """A process's stacks socket: an abstract Unix address (no file to leave behind, gone with
    the process), named after the process's identity."""
    return f"\0posttrain-stacks-{pid}-{start_time}".encode()


def _start_stack_server() -> socket.socket | None:
    start_time = process_start_time(os.getpid())
    if not start_time:  # no /proc: no way to find this process again (abstract sockets neither)
        return None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(_address(os.getpid(), start_time))
    except OSError:  # the name is taken (by no process of ours): faulthandler still answers
        server.close()
        return None
    server.listen(16)
    threading.Thread(target=_serve_stacks, args=(server,), name=_SERVER_THREAD, daemon=True).start()
    return server


def _serve_stacks(server: socket.socket) -> None:
    """Answer each connection with this process's stacks, for the same user only: an abstract
    address has no file permissions to keep others out."""
    while True:
        conn, _ = server.accept()
        with conn:
            _pid, uid, _gid = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if uid not in (os.getuid(), 0):
                continue
            # An asker that stops reading does not hold this thread forever.
            conn.settimeout(2 * ANSWER_S)
            try:
                conn.sendall(format_stacks().encode("utf-8", "replace"))
            except OSError:  # the asker gave up (its wait ran out) and closed its end
                continue


def format_stacks() -> str:
    """Every thread's stack but the answering thread's, the main thread first, in
    faulthandler's format (innermost frame first) with each thread's name; ended by a line
    that shows the answer is whole.

    faulthandler reads the frames, called here with the GIL held: one C call that never lets
    it go, so no thread pushes or pops a frame or ends meanwhile. Walking the frames in Python
    (``sys._current_frames()`` and ``f_back``) lets other threads run between two steps, and
    on CPython 3.11 ``f_back`` of a frame that changed meanwhile crashed a rank of a live run
    (python/cpython#99110, #111363 report the same)."""
    fd = os.memfd_create("posttrain-stacks")
    try:
        faulthandler.dump_traceback(fd, all_threads=True)
        size = os.lseek(fd, 0, os.SEEK_CUR)
        os.lseek(fd, 0, os.SEEK_SET)
        dump = os.read(fd, size).decode("utf-8", "replace")
    finally:
        os.close(fd)
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    blocks = []
    for block in dump.split("\n\n"):
        head = _THREAD.match(block)
        if head is None or block.startswith("Current thread"):  # this thread, answering
            continue
        ident = int(head.group(1), 16)
        name = names.get(ident, "?")
        named = block.replace(
            " (most recent call first):", f" [{name}] (most recent call first):", 1
        )
        blocks.append((ident != main, named.rstrip("\n")))
    body = "\n\n".join(block for _, block in sorted(blocks, key=lambda b: b[0]))
    return f"{_MAIN_THREAD_HEADER}0x{main:016x}\n{body}\n\n{_END_OF_ANSWER}"


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


def collect_stacks(
    targets: list[StackTarget], wait_s: float = 5.0, answer_s: float = ANSWER_S
) -> dict[str, str]:
    """Each target's stacks (every thread's, in faulthandler's format), by label; a target that
    cannot be asked (another node, gone, no answer) gets a line that says why. Each process is
    asked on its socket; one that does not answer in ``answer_s`` is asked by faulthandler,
    and its dump starts with a line that says so."""
    here = this_node()
    out: dict[str, str] = {}
    asked: dict[str, socket.socket | None] = {}
    for t in targets:
        if t.node != here:
            out[t.label] = f"(on node {t.node}: stacks are taken on this node only)\n"
        elif process_start_time(t.pid) != t.start_time or not t.start_time:
            out[t.label] = f"(process {t.pid} has exited)\n"
        else:
            asked[t.label] = _connect(t)
    answers = _answers({label: conn for label, conn in asked.items() if conn}, answer_s)
    out.update(answers)
    late = [t for t in targets if t.label in asked and t.label not in answers]
    out.update(_faulthandler_dumps(late, max(wait_s - answer_s, 1.0), answer_s))
    return {t.label: out[t.label] for t in targets}


def _connect(t: StackTarget) -> socket.socket | None:
    """A connection to the target's stacks socket, or None where nothing listens (a process
    that started before it could, or that runs an older posttrain) or where another process
    listens under its name."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_address(t.pid, t.start_time))
        pid, _uid, _gid = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
    except OSError:
        conn.close()
        return None
    if pid != t.pid:
        conn.close()
        return None
    return conn


def _answers(conns: dict[str, socket.socket], wait_s: float) -> dict[str, str]:
    """The whole answers that came on ``conns`` within ``wait_s``, read side by side."""
    received = {label: bytearray() for label in conns}
    whole: dict[str, str] = {}
    with selectors.DefaultSelector() as selector:
        for label, conn in conns.items():
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ, label)
        deadline = time.monotonic() + wait_s
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                label = key.data
                try:
                    chunk = conns[label].recv(1 << 16)
                except OSError:  # reset by a process that ended while it answered
                    chunk = b""
                if chunk:
                    received[label] += chunk
                    continue
                selector.unregister(key.fileobj)
                text = received[label].decode("utf-8", "replace")
                if text.endswith(_END_OF_ANSWER):
                    whole[label] = text.removesuffix(_END_OF_ANSWER)
    for conn in conns.values():
        conn.close()
    return whole


def _faulthandler_dumps(
    targets: list[StackTarget], wait_s: float, answer_s: float
) -> dict[str, str]:
    """Stacks dumped by faulthandler, on ``SIGUSR1``, into each target's stacks file: for the
    processes that did not answer from their own thread."""
    note = _FALLBACK_NOTE.format(f"{answer_s:g}")
    out: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for t in targets:
        if not file_head(t.stacks_path).startswith(_MAIN_THREAD_HEADER):
            # Not registered yet (SIGUSR1 would kill it), or its stacks file is gone.
            out[t.label] = f"(no answer from process {t.pid} in {answer_s:g}s)\n"
            continue
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
                out[label] = note + _read_from(by_label[label].stacks_path, before)
                del waiting[label]
            elif not seen or seen[0] != size:
                last_seen[label] = (size, time.monotonic())
    for label, before in waiting.items():
        text = _read_from(by_label[label].stacks_path, before)
        pid = by_label[label].pid
        out[label] = note + text if text else f"(no answer from process {pid} in {wait_s:.0f}s)\n"
    return out


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


@attrs.frozen
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({os.path.basename(self.file)}:{self.line})"


def main_thread_frames(dump: str, stacks_file_head: str = "") -> list[Frame]:
    """The main thread's frames in a dump, innermost first. The thread is known by the ident its
    process wrote at the top of its answer or of its stacks file (else: the dump's first
    thread)."""
    ident = None
    named = re.escape(_MAIN_THREAD_HEADER) + r"(0x[0-9a-f]+)"
    head = re.search(named, stacks_file_head) or re.search(named, dump)
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
    if not frames:
        return frames, dump.strip()
    fallback = " (faulthandler's dump: no answer in time)" if is_fallback(dump) else ""
    return frames, describe(frames) + fallback


def is_fallback(dump: str) -> bool:
    """Whether ``dump`` is faulthandler's (the process did not answer from its own thread)."""
    return dump.startswith(_FALLBACK_NOTE.split("{")[0])


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
            threads = [x for x in dump.splitlines() if not x.startswith(_MAIN_THREAD_HEADER)]
            out.append("\n".join(threads).rstrip())
        elif frames:
            out.extend(format_frames(frames))
    return "\n".join(out)
