"""Two Ray nodes on one machine, started by the commands of docs/multi-node.md ("Try it on one
machine"): the quickstart's two ranks run one on each node, with the local launcher's per-step
metrics; the second node is killed mid-run (every process of it), the error names it with the
rerun line, and the rerun after the node is started again resumes from the last checkpoint to
the end. The page's other commands, which need GPUs or SLURM, are checked as far as one machine
can: their `ray start` options against `ray start --help`, the SLURM script with `bash -n`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import (
    QUICKSTART,
    REPO,
    posttrain_cmd,
    read_metrics,
    run_env,
    run_quickstart,
    small_run,
)

pytest.importorskip("ray")

DOC = REPO / "docs" / "multi-node.md"
RUNS_HERE = "tests/e2e/test_multi_node.py runs these lines"
SHORT = (*small_run(max_steps=4, save_steps=2), "--set", "cluster.start_timeout_s=120")
# Rank 1 (on the second node) kills its whole node at its 4th train step: checkpoint-2 (written
# in the background) had all of step 3 to complete. A resumed run calls train_step twice (steps
# 3 and 4): never a 4th.
KILL_NODE_AT_STEP_4 = (
    "--set",
    "plugins=[kill_plugin]",
    "--set",
    "cluster.runtime_env.env_vars.POSTTRAIN_TEST_KILL_AT_STEP=4",
    "--set",
    "cluster.runtime_env.env_vars.POSTTRAIN_TEST_KILL_NODE=1",
    "--set",
    "cluster.call_timeout_s=120",
)
# Timings and counts of this machine, not of the run.
NOT_COMPARED = (
    "time/",
    "perf/",
    "rank_time/",
    "idle/",
    "memory/",
)  # the clock and the process sizes


def _docs_examples():
    """tests/core/test_docs_examples.py, whose parser reads the page's blocks here as there."""
    path = REPO / "tests" / "core" / "test_docs_examples.py"
    spec = importlib.util.spec_from_file_location("docs_examples_parser", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS = _docs_examples()


def ray_bin() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray") or "ray"


def one_machine_commands() -> list[list[str]]:
    """The commands of the block the page says this test runs, in order."""
    blocks = [b for b in DOCS.fenced_blocks(DOC) if b.no_run and RUNS_HERE in b.no_run]
    assert len(blocks) == 1, [str(b) for b in blocks]
    return DOCS.commands(blocks[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_members(session: int) -> dict[int, str]:
    """``pid: command line`` of every process of ``session``."""
    members = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if int(fields[3]) == session:
            members[int(entry)] = cmdline
    return members


class Nodes:
    """Ray nodes this test starts, each `ray start` in a session of its own: a node is then
    every process of its session (raylet, agents, the workers it forks), which is what is
    killed, and what teardown stops (never `ray stop`, which stops every Ray of the machine)."""

    def __init__(self, port: int):
        self.port = port
        self.sessions: list[int] = []
        self.temp = {name: tempfile.mkdtemp(prefix=f"ptmn{name}-", dir="/tmp") for name in "ab"}

    def command(self, words: list[str]) -> list[str]:
        """A `ray start` line of the page, on a free port and in short temporary dirs."""
        out = []
        for word in words:
            word = word.replace("6379", str(self.port))
            for name, temp in self.temp.items():
                word = word.replace(f"/tmp/ray_{name}", temp)
            out.append(word)
        return [ray_bin(), *out[1:]]

    def start(self, words: list[str], env: dict[str, str]) -> tuple[int, str]:
        """Run a `ray start` line; its session and its raylet's node id."""
        proc = subprocess.Popen(
            self.command(words),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.sessions.append(proc.pid)  # a session's id is its leader's pid
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        raylets = [c for c in session_members(proc.pid).values() if "raylet/raylet" in c]
        assert len(raylets) == 1, raylets
        node_id = re.search(r"--node_id=([0-9a-f]+)", raylets[0])
        assert node_id, raylets[0]
        return proc.pid, node_id[1]

    def stop(self) -> None:
        for session in self.sessions:
            for pid in session_members(session):
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    os.kill(pid, signal.SIGKILL)
        for temp in self.temp.values():
            shutil.rmtree(temp, ignore_errors=True)


def compared(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics, the later record of a step winning (a resumed run appends)."""
    return {
        m["step"]: {k: v for k, v in m.items() if not k.startswith(NOT_COMPARED)}
        for m in read_metrics(run_dir)
    }


def flat(text: str) -> str:
    return " ".join(text.split())  # the console wraps long lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ray_nodes_one_rank_each_node_killed_then_rerun(tmp_path, e2e_cache):
    head, worker, run_line, stop_line = one_machine_commands()
    assert head[:3] == ["ray", "start", "--head"], head
    assert worker[:2] == ["ray", "start"] and worker[2].startswith("--address="), worker
    assert run_line[:2] == ["posttrain", "run"] and stop_line == ["ray", "stop"]  # not run: global
    # The local launcher's run, beside the nodes' start-up (which mostly waits).
    local_dir = tmp_path / "local"
    local_log = tmp_path / "local.log"
    with open(local_log, "w") as log:
        local = subprocess.Popen(
            posttrain_cmd(
                "run", str(QUICKSTART), "--set", f"trainer.output_dir={local_dir}", *SHORT
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=run_env(),
        )
    nodes = Nodes(free_port())
    # Ray's workers inherit their raylet's environment: kill_plugin is importable on both nodes.
    env = run_env(RAY_AUTH_MODE="disabled")
    # The head's health checks every 0.5 s (not 3 s, 5 misses): the killed node is marked dead
    # before it is started again, so the rerun cannot pick the dead one.
    head_env = {
        **env,
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "3",
    }
    try:
        _, node_a = nodes.start(head, head_env)
        session_b, node_b = nodes.start(worker, env)
        assert node_a != node_b

        # The page's run line, into this test's run directory, short, with the node killer.
        sets = [w.replace("6379", str(nodes.port)) for w in run_line[3:]]
        at = sets.index(next(w for w in sets if w.startswith("trainer.output_dir=")))
        del sets[at - 1 : at + 1]
        run_dir = tmp_path / "two_nodes"
        command = (*sets, *SHORT, *KILL_NODE_AT_STEP_4)
        crash = run_quickstart(run_dir, *command, env=env, check=False, workflow=REPO / run_line[2])
        out, err = flat(crash.stdout), flat(crash.stderr)

        # (a) One rank on each node (Ray's node ids, from the raylets' command lines).
        on_nodes = rf"on 2 nodes: rank 0 on \S+ \[[^\]]*Ray node {node_a[:8]}\]; rank 1 on \S+ \["
        assert re.search(on_nodes + rf"[^\]]*Ray node {node_b[:8]}\]", out), out[-3000:]

        # (c) The node is gone, and the error names it, with the exit code and the rerun line.
        assert crash.returncode == 1, crash.stdout[-3000:] + crash.stderr[-3000:]
        assert not [c for c in session_members(session_b).values() if "raylet" in c]
        assert [line.startswith("error:") for line in crash.stderr.splitlines()].count(True) == 1
        lost = re.search(r"error: actor_train rank 1 \([^)]*\): (.*?) \(node ([^()]*\])\)", err)
        assert lost, err[-3000:]
        # "died" once Ray's health checks have found the node dead, "lost" before; never a
        # timeout, nor rank 0's error in the collective it shared with rank 1.
        assert lost[1] in (
            "worker actor lost during train_step: its process or its node is gone",
            "worker actor died during train_step",
        ), lost[1]
        assert f"Ray node {node_b[:8]}" in lost[2] and node_a[:8] not in lost[2]
        assert "kill_plugin: killing node" in err  # the rank's last log lines
        checkpoint = run_dir / "checkpoint-2"
        assert f"the last complete checkpoint is {checkpoint}: rerun the same command to " in err
        assert "continue from step 2, redoing step 3" in err
        assert (checkpoint / "manifest.json").exists() and not (run_dir / "checkpoint-4").exists()

        # (d) The node started again (a new node id); the same command resumes and finishes.
        _, node_b2 = nodes.start(worker, env)
        rerun = run_quickstart(run_dir, *command, env=env, workflow=REPO / run_line[2])
        assert f"resumed from {checkpoint}" in flat(rerun.stdout), rerun.stdout[-3000:]
        assert re.search(on_nodes + rf"[^\]]*Ray node {node_b2[:8]}\]", flat(rerun.stdout)), (
            rerun.stdout[-3000:]
        )
        assert (run_dir / "checkpoint-4" / "manifest.json").exists()
        local.wait(timeout=300)
    finally:
        nodes.stop()
        if local.poll() is None:  # the test failed before it
            local.kill()
            local.wait(timeout=30)

    # (b) Steps 1-2 (the killed run's) and 3-4 (the rerun's) equal the local launcher's, bitwise.
    assert local.returncode == 0, local_log.read_text()[-3000:]
    expected = compared(local_dir)
    assert sorted(expected) == [1, 2, 3, 4]
    assert compared(run_dir) == expected


def test_ray_start_options_of_the_page_exist():
    """Every option of every `ray start` on the page (the cluster's, SLURM's) is one that
    `ray start --help` lists: the lines no test can run are at least well-formed."""
    help_text = subprocess.run(
        [ray_bin(), "start", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    known = set(re.findall(r"(--[a-z][\w-]*)", help_text))
    used = []
    for block in (b for b in DOCS.fenced_blocks(DOC) if b.lang == "bash"):
        for words in DOCS.commands(block):
            starts = [i for i in range(len(words) - 1) if words[i : i + 2] == ["ray", "start"]]
            for i in starts:  # `ray start ...`, or `srun ... ray start ...`
                used += [w.split("=")[0] for w in words[i + 2 :] if w.startswith("--")]
    # The one-machine lines', the cluster's and SLURM's were all found.
    assert {"--temp-dir", "--num-gpus", "--block", "--node-ip-address"} <= set(used), used
    assert not set(used) - known, set(used) - known


def test_slurm_script_is_bash():
    scripts = [b for b in DOCS.fenced_blocks(DOC) if b.text.startswith("#!/bin/bash\n#SBATCH")]
    assert len(scripts) == 1
    check = subprocess.run(["bash", "-n"], input=scripts[0].text, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
