"""A rank killed mid-run, measured (docs/reliability.md's promises): how long the driver takes to
stop once rank 1 dies, its exit code and error, whether any rank process outlives it, on GPUs the
memory still in use after it, and whether the rerun with ``trainer.resume: auto`` is the same run
as an uninterrupted one (every step's metrics equal, bitwise, timings and memory aside).

Three runs of rl_step.py's hybrid GRPO workflow (a random model of ``--shape``, no download) on
2 devices, each saving every ``--save-steps`` steps: uninterrupted for ``--steps`` steps; the same
with the fault kit's ``kill_rank:S/rank=1`` (rank 1 SIGKILLs itself at the start of its S-th
training step, ``--kill-at``); then the rerun of the killed one, without the fault.

    python benchmarks/rank_kill.py --device cuda --shape qwen2-0.5b --decode cuda_graph  # 2 GPUs
    python benchmarks/rank_kill.py --device cpu --shape tiny    # CPU smoke check: 2 gloo ranks

The kill's time is the last write of rank 1's log (the fault kit prints its line, then kills);
the driver's exit, when its process ends. The run's processes are the ranks it lists for
``posttrain stacks`` (RUN_DIR/logs/processes.json), every process descended from its driver
while it ran, and any process whose command line names the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import device_name, posttrain_run_command, print_table
from memory_flat import grpo_workflow
from rl_step import add_workload_arguments, default_workload

# Figures that are not the run's own: how long, how much memory, how many driver calls, and how
# many buckets a sync's check summed (the first sync of each process sums all of them).
VOLATILE = (
    "time/",
    "rank_time/",
    "memory/",
    "perf/",
    "idle/",
    "driver/",
    "checkpoint/",
    "weight_sync/verified",
)
KILL_LINE = "faults: rank 1 kills itself"
# How long rank processes and GPU memory are watched after the killed run's driver exits.
AFTER_EXIT_S = 10.0


class Watch(threading.Thread):
    """While a run is under way: the pids of its rank processes and of every other process
    descended from its driver (the launcher's fork server and resource tracker: the ranks are
    the fork server's children, not the driver's), each with its start time (its identity with
    the pid), and the moment rank 1's log says it kills itself."""

    def __init__(self, run_dir: Path, driver: int):
        super().__init__(daemon=True)
        self.run_dir, self.driver = run_dir, driver
        self.ranks: dict[int, str] = {}  # pid -> /proc start time
        self.descendants: dict[int, str] = {}
        self.kill_seen: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        polls = 0
        while not self.done.wait(0.02):
            self.poll()
            polls += 1
            if polls % 25 == 0:  # a walk of /proc: twice a second
                self.walk()

    def walk(self) -> None:
        parents: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(parent, []).append(int(entry.name))
        todo = list(parents.get(self.driver, []))
        while todo:
            pid = todo.pop()
            started = start_time(pid)
            if started is not None:
                self.descendants[pid] = started
            todo += parents.get(pid, [])

    def poll(self) -> None:
        try:
            listed = json.loads((self.run_dir / "logs" / "processes.json").read_text())
        except (OSError, json.JSONDecodeError):
            listed = []  # not written yet, or being replaced
        for target in listed:
            if target["label"] != "driver":
                self.ranks[target["pid"]] = target["start_time"]
        if self.kill_seen is None and KILL_LINE in rank1_log_text(self.run_dir):
            self.kill_seen = time.time()


def rank1_log_text(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.rank1.log"))


def kill_time(run_dir: Path, seen: float | None) -> float | None:
    """When rank 1 killed itself: its log's last write (the fault kit's line, flushed just
    before the kill), else when the watch saw the line."""
    for path in (run_dir / "logs").glob("*.rank1.log"):
        if KILL_LINE in path.read_text(errors="replace"):
            return path.stat().st_mtime
    return seen


def start_time(pid: int) -> str | None:
    """/proc/PID/stat's start time, or None where the process is gone or a zombie (which holds
    no memory and waits only to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def left_over(processes: dict[int, str], run_dir: Path) -> list[int]:
    """Those of ``processes`` (pid -> start time) still alive, and any other live process
    naming ``run_dir``."""
    alive = {pid for pid, started in processes.items() if start_time(pid) == started}
    mine = str(run_dir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if mine in cmdline and start_time(int(entry.name)) is not None:
            alive.add(int(entry.name))
    return sorted(alive)


def gpu_memory_mib(device: str) -> str | None:
    """Memory in use on each GPU (MiB), by nvidia-smi where there is one, else by a fresh
    process's torch.cuda.mem_get_info; None on the CPU."""
    if device != "cuda":
        return None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return " / ".join(line.strip() for line in out.splitlines() if line.strip())
    code = (
        "import torch\n"
        "for i in range(torch.cuda.device_count()):\n"
        "    free, total = torch.cuda.mem_get_info(i)\n"
        "    print((total - free) >> 20)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    return " / ".join(out.split())


class Run:
    """One ``posttrain run`` of the workflow into ``run_dir``, watched."""

    def __init__(self, path: Path, run_dir: Path, overrides: list[str], timeout_s: float):
        self.path, self.run_dir = path, run_dir
        self.overrides, self.timeout_s = overrides, timeout_s
        self.calls = 0

    def __call__(self, faults: str = "") -> dict:
        env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_FAULTS"}
        if faults:
            env["POSTTRAIN_FAULTS"] = faults
        command = posttrain_run_command(
            self.path, [f"trainer.output_dir={self.run_dir}", *self.overrides]
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.calls += 1
        out_path = self.run_dir.parent / f"{self.run_dir.name}.{self.calls}.out"
        err_path = out_path.with_suffix(".err")
        start = time.time()
        with open(out_path, "a") as out, open(err_path, "a") as err:
            # A session of its own: a run that outlives --run-timeout is stopped with its ranks.
            proc = subprocess.Popen(
                command, stdout=out, stderr=err, env=env, start_new_session=True
            )
            watch = Watch(self.run_dir, proc.pid)
            watch.start()
            timed_out = False
            try:
                returncode = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            finally:
                # Stopped here too when this script is (SIGTERM from `timeout`, Ctrl-C): the run
                # is in a session of its own, which no signal to this one reaches.
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    returncode = proc.wait()
        exited = time.time()
        watch.done.set()
        watch.join()
        watch.poll()
        return {
            "returncode": returncode,
            "timed_out": timed_out,
            "wall_s": exited - start,
            "exited": exited,
            "stdout": out_path.read_text(errors="replace"),
            "stderr": err_path.read_text(errors="replace"),
            "ranks": watch.ranks,
            "processes": {**watch.descendants, **watch.ranks},
            "kill_seen": watch.kill_seen,
        }


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's records by step (a resumed run rewrote the killed run's later steps)."""
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records}


def compare(reference: dict[int, dict], resumed: dict[int, dict], after: int) -> dict:
    """Steps after ``after`` whose records equal the reference's, bitwise (JSON keeps every
    float's bits), and the first difference."""
    steps = [s for s in sorted(reference) if s > after]
    equal = [s for s in steps if resumed.get(s) == reference[s]]
    first = None
    for step in steps:
        got, want = resumed.get(step, {}), reference[step]
        keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        if keys:
            first = f"step {step}: {keys[0]} {want.get(keys[0])!r} -> {got.get(keys[0])!r}"
            break
    return {"steps": steps, "equal": equal, "first_difference": first}


def resumed_at(stdout: str) -> int | None:
    """The step the rerun resumed at, from its console line (which the console may wrap)."""
    _, found, rest = stdout.partition("resumed from")
    match = re.search(r"at\s+step\s+(\d+)", rest) if found else None
    return int(match.group(1)) if match else None


def after_exit(killed: dict, run_dir: Path, device: str) -> dict:
    """The run's processes left when its driver exited, and how soon they were all gone
    (watched for AFTER_EXIT_S); GPU memory in use at that moment and at the end."""
    at_exit = command_lines(left_over(killed["processes"], run_dir))
    gpu_at_exit = gpu_memory_mib(device)
    gone_s = 0.0 if not at_exit else None
    remaining = at_exit
    while remaining and time.time() - killed["exited"] < AFTER_EXIT_S:
        time.sleep(0.05)
        remaining = command_lines(left_over(killed["processes"], run_dir))
        if not remaining:
            gone_s = time.time() - killed["exited"]
    return {
        "at_exit": at_exit,
        "remaining": remaining,
        "gone_s": gone_s,
        "gpu_at_exit": gpu_at_exit,
        "gpu_later": gpu_memory_mib(device),
    }


def describe(processes: dict[int, str], ranks: dict[int, str]) -> str:
    """How many processes, how many of them ranks, and what the others ran (``processes``: pid
    -> command line, read while they were alive)."""
    if not processes:
        return "0"
    others = [short(line) for pid, line in processes.items() if pid not in ranks]
    text = f"{len(processes)} ({len(processes) - len(others)} ranks)"
    return text + (f": {'; '.join(others)}" if others else "")


def short(command_line: str) -> str:
    """A process's command line, shortened: multiprocessing's helpers by their module name."""
    helper = re.search(r"from multiprocessing\.(\w+) import", command_line)
    return f"multiprocessing {helper.group(1)}" if helper else command_line[:70]


def command_lines(pids: list[int]) -> dict[int, str]:
    lines = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            raw = b"(gone before its command line was read)"
        lines[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return lines


def ended(run: dict) -> str:
    """How a run ended: its exit code and wall time, or that this script stopped it."""
    if run["timed_out"]:
        return f"did not exit: stopped after {run['wall_s']:.0f} s (--run-timeout)"
    return f"exit {run['returncode']}, {run['wall_s']:.1f} s"


def table_rows(args, clean: dict, killed: dict, rerun: dict, left: dict, gpu_before) -> list:
    run_dir = args.run_dir
    killed_at = killed["killed_at"]
    # The driver's own error lines (the rest of its output echoes rank 1's last words, which
    # name it anyway).
    errors = [line.strip() for line in killed["stderr"].splitlines() if line.startswith("error")]
    names_rank = any(re.search(r"rank 1\b", line) for line in errors)
    reference = metrics_by_step(args.clean_dir) if clean["returncode"] == 0 else {}
    resumed = metrics_by_step(run_dir) if rerun["returncode"] == 0 else {}
    at = resumed_at(rerun["stdout"])
    after = compare(reference, resumed, at or 0)
    whole = compare(reference, resumed, 0)
    rows = [
        ("uninterrupted run", ended(clean)),
        ("killed run", ended(killed)),
        (
            "kill -> driver exit (s)",
            f"{killed['exited'] - killed_at:.2f}" if killed_at else "no kill seen",
        ),
        ("error names rank 1", "yes" if names_rank else "no"),
        ("error", errors[0][:160] if errors else "-"),
        (
            "processes watched",
            f"{len(killed['processes'])}, {len(killed['ranks'])} of them ranks",
        ),
        ("processes left at driver exit", describe(left["at_exit"], killed["ranks"])),
        (
            f"all gone within {AFTER_EXIT_S:.0f} s",
            f"yes, at +{left['gone_s']:.2f} s"
            if left["gone_s"] is not None
            else f"no: {describe(left['remaining'], killed['ranks'])}",
        ),
    ]
    if args.device == "cuda":
        rows += [
            ("GPU MiB in use before the killed run", gpu_before),
            ("GPU MiB in use at driver exit", left["gpu_at_exit"]),
            (f"GPU MiB in use {AFTER_EXIT_S:.0f} s after", left["gpu_later"]),
        ]
    rows += [
        ("rerun (resume: auto)", ended(rerun)),
        ("resumed at step", str(at) if at is not None else "from scratch"),
        (
            "steps after resume equal, bitwise",
            f"{len(after['equal'])} of {len(after['steps'])}",
        ),
        ("every step equal, bitwise", f"{len(whole['equal'])} of {len(whole['steps'])}"),
        ("first difference", whole["first_difference"] or "none"),
    ]
    return [{"measure": name, "value": value} for name, value in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, shape="qwen2-0.5b")
    parser.add_argument("--steps", type=int, default=8, help="steps of each run (K)")
    parser.add_argument("--kill-at", type=int, default=5, help="rank 1's training step killed (S)")
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=240,
        help="seconds a run may take before it is stopped (a driver that never exits is a "
        "finding: the table says so)",
    )
    args = parser.parse_args()
    if not 1 <= args.kill_at <= args.steps:
        parser.error(f"--kill-at {args.kill_at} is not a step of the run (1..{args.steps})")
    args.workload = default_workload(args)
    args.gpus = 2  # hybrid on 2 devices: 2 rank processes, each hosting every role
    # A SIGTERM (`timeout`) unwinds like Ctrl-C: the run under way is stopped, the temporary
    # directory removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("rank_kill.py: terminated"))

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        path, params = grpo_workflow(args, tmp_path)
        overrides = [
            "trainer.logger=[jsonl]",
            f"trainer.save_steps={args.save_steps}",
            "trainer.resume=auto",
            # Two checkpoints a run directory at most: a larger shape's saves fill no disk.
            "trainer.save_total_limit=2",
            # In every run, so that the three are the same workflow to the resume's check.
            "plugins=[posttrain.testing.faults]",
            *args.set,
        ]
        args.clean_dir, args.run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
        clean = Run(path, args.clean_dir, overrides, args.run_timeout)()
        for checkpoint in args.clean_dir.glob("checkpoint-*"):
            shutil.rmtree(checkpoint)  # its metrics are what is compared
        gpu_before = gpu_memory_mib(args.device)
        run = Run(path, args.run_dir, overrides, args.run_timeout)
        killed = run(faults=f"kill_rank:{args.kill_at}/rank=1")
        # Read before the rerun, which writes to the same rank logs.
        killed["killed_at"] = kill_time(args.run_dir, killed["kill_seen"])
        left = after_exit(killed, args.run_dir, args.device)
        rerun = run()
        rows = table_rows(args, clean, killed, rerun, left, gpu_before)
        for name, result in (("uninterrupted", clean), ("rerun", rerun)):
            if result["returncode"]:
                print(f"\n{name} run failed; its output's tail:\n{result['stderr'][-3000:]}")

    print(
        f"\nrank 1 killed at step {args.kill_at} of {args.steps} (saves every "
        f"{args.save_steps}): {args.shape} ({params / 1e9:.2f}B), {args.workload} workload, "
        f"hybrid on 2 x {device_name(args.device)}, {args.trainer}"
    )
    print_table(rows, text_columns=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
