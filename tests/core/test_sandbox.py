"""Hostile programs through the local sandbox: each has a stated outcome, and the host is
checked afterwards (its files, its processes, its memory, the caller still alive).

Each test runs at every isolation level this machine offers (``bubblewrap`` where bwrap runs,
``rlimits`` always) and asserts what the detected guarantees promise; where a guarantee does not
hold at a level, the test says so in its skip reason (docs/sandbox.md lists them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from posttrain.sandbox import isolation as iso
from posttrain.sandbox.local import run_python
from posttrain.sandbox.result import SandboxLimits

FOUND = iso.detect()
pytestmark = [
    pytest.mark.skipif(FOUND.prlimit is None, reason="util-linux's prlimit is missing"),
    pytest.mark.skipif(
        not os.path.isfile("/usr/bin/python3"), reason="no /usr/bin/python3, the interpreter"
    ),
]
LEVELS = [
    pytest.param(
        "bubblewrap",
        marks=pytest.mark.skipif(not FOUND.bubblewrap, reason=FOUND.bubblewrap_problem),
    ),
    "rlimits",
]
FAST = SandboxLimits(timeout_s=1.5, max_processes=16)


def holds(level: str, name: str) -> bool:
    (guarantee,) = [g for g in FOUND.guarantees(level) if g.name == name]
    return guarantee.holds


def require(level: str, name: str) -> None:
    if not holds(level, name):
        pytest.skip(f"'{name}' does not hold with isolation {level} on this machine")


def processes_with(marker: str) -> list[int]:
    """Pids of the host's processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read()
            with open(f"/proc/{entry}/stat") as file:
                zombie = file.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # ended while we looked
            continue
        if marker.encode() in cmdline and not zombie:
            found.append(int(entry))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signal.SIGKILL)


def sandbox_cli(tmp_path, code: str, *flags: str, measure_rss: bool = False):
    """``posttrain sandbox run`` in a process of its own; (exit status, JSON, peak RSS in KiB)."""
    program = tmp_path / f"program-{uuid.uuid4().hex[:8]}.py"
    program.write_text(code)
    driver = (
        "import resource, sys\n"
        "from posttrain.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(status)\n"
    )
    env = {**os.environ, "POSTTRAIN_PLUGINS": ""}  # no third-party plugin is needed here
    proc = subprocess.run(
        [sys.executable, "-c", driver, "sandbox", "run", str(program), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("RSS ")]
    result = json.loads(proc.stdout) if proc.returncode == 0 else None
    return proc.returncode, result, (rss[0] if rss else None), proc.stderr


@pytest.mark.parametrize("level", LEVELS)
def test_infinite_loop_times_out(level):
    started = time.monotonic()
    result = run_python("while True:\n    pass\n", FAST, isolation=level)
    assert result.timed_out and result.killed_reason == "timeout"
    assert time.monotonic() - started < FAST.timeout_s + 2.0


@pytest.mark.parametrize("level", LEVELS)
def test_cpu_limit_ends_a_busy_loop_before_the_wall_clock(level):
    limits = SandboxLimits(timeout_s=20, cpu_time_s=1)
    started = time.monotonic()
    result = run_python("while True:\n    pass\n", limits, isolation=level)
    assert not result.timed_out and result.killed_reason == "cpu", result
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("level", LEVELS)
def test_memory_exhaustion_is_stopped_with_reason_memory(level):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n"
    result = run_python(code, SandboxLimits(timeout_s=10, memory_mb=256), isolation=level)
    assert not result.timed_out
    assert result.killed_reason == "memory", result
    assert result.exit_code == 1 and "MemoryError" in result.stderr


@pytest.mark.parametrize("level", LEVELS)
def test_fork_bomb_is_bounded_and_leaves_nothing_running(level):
    require(level, "process-count limit")
    marker = f"posttrain-bomb-{uuid.uuid4().hex}"
    # Children hold the marker in their command line: the test finds any that outlive the run.
    counted = (
        "import os, sys, time\n"
        "n = 0\n"
        "while n < 1000:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
        f"'{marker}'])\n"
        "    n += 1\n"
        "print(n)\n"
    )
    result = run_python(counted, SandboxLimits(timeout_s=10, max_processes=16), isolation=level)
    assert result.exit_code == 0, result
    assert 0 < int(result.stdout) < 16
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(bomb, FAST, isolation=level)
    assert result.timed_out
    leftover = processes_with(marker)
    kill_all(leftover)
    assert leftover == []
    assert subprocess.run(["true"]).returncode == 0  # the host still starts processes


@pytest.mark.parametrize("level", LEVELS)
def test_writes_outside_the_working_directory_never_reach_the_host(level, tmp_path):
    own = tmp_path / "written-by-the-sandbox.txt"  # the caller's directory
    shared = f"/tmp/posttrain-sandbox-escape-{uuid.uuid4().hex}"  # writable by anyone
    code = (
        "import os\n"
        f"for path in [{str(own)!r}, {shared!r}]:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('escaped')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print('cwd', os.getcwd(), open('inside.txt').read())\n"
    )
    result = run_python(code, FAST, isolation=level)
    try:
        assert result.exit_code == 0, result
        assert "fine" in result.stdout  # the working directory is writable
        if holds(level, "no view of the caller's files") or os.geteuid() == 0:
            assert not own.exists()  # hidden (bubblewrap) or not the run's to write (nobody)
        if holds(level, "no view of the caller's files"):
            assert not os.path.exists(shared)  # it landed in the run's throwaway /tmp
        elif os.path.exists(shared):
            pytest.skip(f"with isolation {level} the program wrote {shared} on the host")
    finally:
        if os.path.exists(shared):
            os.remove(shared)


def test_filling_the_disk_stops_at_the_working_directory_size():
    """Under bubblewrap every writable place is a tmpfs of workdir_mb, held in the host's
    memory: filling them stops there (without bubblewrap the working directory is on the host's
    disk, bounded per file only, as docs/sandbox.md says)."""
    if not FOUND.bubblewrap:
        pytest.skip(f"needs bubblewrap: {FOUND.bubblewrap_problem}")
    code = (
        "written = {}\n"
        "for place in ('/tmp', '.', '/', '/dev/shm'):\n"
        "    written[place] = 0\n"
        "    try:\n"
        "        for i in range(100):\n"
        "            with open(f'{place}/fill{i}', 'wb') as f:\n"
        "                f.write(b'x' * 2**22)\n"
        "            written[place] += 4\n"
        "    except OSError as exc:\n"
        "        print(place, written[place], exc.strerror)\n"
    )
    result = run_python(code, SandboxLimits(workdir_mb=16, timeout_s=10), isolation="bubblewrap")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("/tmp ") and lines[1].startswith(". "), result
    assert all(int(line.split()[1]) <= 16 for line in lines[:2])
    assert "No space left on device" in lines[0]
    assert lines[2:] == ["/ 0 Read-only file system", "/dev/shm 0 Read-only file system"]


@pytest.mark.parametrize("level", LEVELS)
def test_a_file_of_the_caller_cannot_be_read(level, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the caller's secret")
    secret.chmod(0o644)  # readable by anyone the directories let through
    if not holds(level, "no view of the caller's files") and os.geteuid() != 0:
        pytest.skip(f"with isolation {level} the program runs as the caller and sees its files")
    code = f"print(open({str(secret)!r}).read())\n"
    result = run_python(code, FAST, isolation=level)
    assert result.exit_code == 1
    assert "the caller's secret" not in result.stdout
    expected = "FileNotFoundError" if holds(level, "no view of the caller's files") else "Error"
    assert expected in result.stderr


@pytest.mark.parametrize("level", LEVELS)
def test_a_port_the_caller_listens_on_cannot_be_reached(level):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print('unreachable', type(exc).__name__)\n"
        )
        result = run_python(code, FAST, isolation=level)
        if not holds(level, "no network"):
            # What posttrain doctor says ("no network: no") is true: the caller saw it connect.
            assert result.stdout == "connected\n", result
            listener.accept()[0].close()
            pytest.skip(f"with isolation {level} the program reaches the caller's port")
        assert result.stdout == "unreachable ConnectionRefusedError\n", result
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came in


def test_100_mb_of_output_is_truncated_without_host_memory(tmp_path):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n"
    status, result, rss_kib, stderr = sandbox_cli(tmp_path, code, "--max-output-bytes", "4096")
    assert status == 0, stderr
    assert result["stdout"] == "x" * 4096 and result["stdout_truncated"]
    assert not result["timed_out"] and result["exit_code"] == 0
    _, _, baseline_kib, _ = sandbox_cli(tmp_path, "print(1)\n")
    # The 100 MB went through the caller's pipe and were dropped: its peak memory barely moved.
    assert rss_kib - baseline_kib < 20 * 1024, (rss_kib, baseline_kib)


def test_killing_its_parent_leaves_the_caller_alive(tmp_path):
    level = FOUND.best
    require(level, "cannot signal the caller")
    code = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')\n"
    status, result, _, stderr = sandbox_cli(tmp_path, code)
    # The CLI (the caller) lived to print its JSON and exit 0, whatever the program's fate.
    assert status == 0, stderr
    assert result["isolation"] == level
    assert result["exit_code"] == 0 or "PermissionError" in result["stderr"], result


@pytest.mark.parametrize("level", LEVELS)
def test_a_daemonised_child_is_gone_after_return(level):
    marker = f"posttrain-daemon-{uuid.uuid4().hex}"
    # The parent returns only once the daemon runs (it writes to a pipe after its exec): a
    # fixed wait lost the race on a loaded machine. A fork may briefly find the process limit
    # reached: without bubblewrap, runs as root share `nobody`'s count, and the fork bomb's
    # processes before this test may still be being reaped.
    code = (
        "import os, sys, time\n"
        "def fork():\n"
        "    for _ in range(100):\n"
        "        try:\n"
        "            return os.fork()\n"
        "        except BlockingIOError:\n"
        "            time.sleep(0.05)\n"
        "    return os.fork()\n"
        "r, w = os.pipe()\n"
        "os.set_inheritable(w, True)\n"
        "if fork() == 0:\n"
        "    os.setsid()\n"
        "    if fork() == 0:\n"
        "        daemon = f'import os, time; os.write({w}, b\"x\"); time.sleep(60)'\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', daemon, '{marker}'])\n"
        "    os._exit(0)\n"
        "os.read(r, 1)\n"
        "print('parent done')\n"
    )
    result = run_python(code, FAST, isolation=level)
    assert result.stdout == "parent done\n" and not result.timed_out, result
    leftover = processes_with(marker)
    kill_all(leftover)  # leave the host clean whatever the outcome
    if holds(level, "every process gone on return"):
        assert leftover == []
    else:
        assert leftover, "a daemon escaped the process group, as documented, but none was found"
        pytest.skip(f"with isolation {level} a child with a session of its own outlives the run")
