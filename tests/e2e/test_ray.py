"""The ``ray`` launcher end to end: same rewards as ``local``, joining an existing cluster,
cleaning up a Ray instance it started, a killed rank, colocated and disaggregated layouts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import (
    HANG_AT_STEP_5,
    assert_hang_reported,
    read_metrics,
    run_env,
    run_quickstart,
    small_run,
)

pytest.importorskip("ray")

SMALL = small_run(max_steps=6, save_steps=3)
RAY = ("--set", "cluster.launcher=ray", "--set", "cluster.object_store_memory=268435456")


def run(run_dir: Path, *extra: str, env=None, check=True, timeout=300):
    return run_quickstart(
        run_dir,
        *SMALL,
        *extra,
        env=env or run_env(RAY_AUTH_MODE="disabled"),
        check=check,
        timeout=timeout,
    )


def rewards(run_dir: Path) -> list[float]:
    return [m["reward/mean"] for m in read_metrics(run_dir)]


def raylets() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_matches_local_rewards_and_leaves_nothing_running(tmp_path, e2e_cache):
    before = raylets()
    run(tmp_path / "local")
    run(tmp_path / "ray", *RAY)
    local, ray_ = rewards(tmp_path / "local"), rewards(tmp_path / "ray")
    assert len(local) == len(ray_) == 6
    assert ray_ == pytest.approx(local, abs=1e-6)
    logs = sorted(p.name for p in (tmp_path / "ray" / "logs").iterdir())
    # The quickstart's three roles share their 2 rank processes (one actor per rank); each
    # process, the driver's too, has a file for its stacks (the hang watchdog's), and the
    # driver one for the stack of a fatal signal (launch/fatal.py).
    assert logs == [
        "actor_train+actor_infer+reference.rank0.log",
        "actor_train+actor_infer+reference.rank0.stacks",
        "actor_train+actor_infer+reference.rank1.log",
        "actor_train+actor_infer+reference.rank1.stacks",
        "driver.fatal.log",
        "driver.stacks",
    ]
    # The Ray instance posttrain started is gone with its processes.
    deadline = time.monotonic() + 20
    while raylets() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not raylets() - before


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_join_existing_cluster_and_leave_it_up(tmp_path, e2e_cache):
    temp = tempfile.mkdtemp(prefix="ptrt-", dir="/tmp")
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = run_env(RAY_AUTH_MODE="disabled", RAY_ADDRESS=address)
    ray_bin = str(Path(sys.executable).parent / "ray")
    if not os.path.exists(ray_bin):
        ray_bin = shutil.which("ray") or "ray"
    start = [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=4"]
    start += ["--include-dashboard=false", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    try:
        run(tmp_path / "joined", *RAY, "--set", "cluster.address=auto", env=env)
        # The head is up, and the run's actors and placement groups gave all 4 CPUs back.
        probe = (
            "import time, ray; ray.init(address='auto', log_to_driver=False)\n"
            "for _ in range(40):\n"
            "    if ray.available_resources().get('CPU') == 4.0: break\n"
            "    time.sleep(0.5)\n"
            "print('CPUS', ray.cluster_resources().get('CPU'), "
            "ray.available_resources().get('CPU')); ray.shutdown()"
        )
        alive = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
        )
        assert "CPUS 4.0 4.0" in alive.stdout, alive.stdout + alive.stderr
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


# In the default run, test_random_kills.py's chains kill at such points (extended: this one
# kills at fixed points and checks more of what the console says).
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_rank_fails_the_run_then_resume_finishes(tmp_path, e2e_cache):
    run_dir = tmp_path / "killed"
    kill = (
        "--set",
        "plugins=[kill_plugin]",
        "--set",
        "cluster.runtime_env.env_vars.POSTTRAIN_TEST_KILL_AT_STEP=5",
        "--set",
        "cluster.call_timeout_s=60",
    )
    start = time.monotonic()
    crash = run(run_dir, *RAY, *kill, check=False)
    elapsed = time.monotonic() - start
    assert crash.returncode == 1, crash.stdout[-3000:] + crash.stderr[-3000:]
    assert elapsed < 150
    err = crash.stderr
    assert err.count("error:") == 1, err
    assert "actor_train rank 1" in err
    assert "died" in err and "(node " in err
    assert "last lines of" in err and "kill_plugin: exiting rank 1 at train step 5" in err
    assert (run_dir / "checkpoint-3" / "manifest.json").exists()
    assert not (run_dir / "checkpoint-6").exists()
    resumed = run(run_dir, *RAY, "--set", "plugins=[kill_plugin]")
    assert "resumed from" in resumed.stdout
    assert [m["step"] for m in read_metrics(run_dir)][-3:] == [4, 5, 6]
    assert (run_dir / "checkpoint-6" / "manifest.json").exists()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("train", "infer", "reference"),
    [("[0,1]", "[0,1]", "[0,1]"), ("[0,1]", "[2]", "[3]")],
    ids=["colocated", "disaggregated"],
)
def test_layouts(tmp_path, e2e_cache, train, infer, reference):
    layout = (
        "--set",
        f"actor_train.device_mapping={train}",
        "--set",
        f"actor_infer.device_mapping={infer}",
        "--set",
        f"reference.device_mapping={reference}",
        "--set",
        "trainer.max_steps=3",
    )
    run(tmp_path / "run", *RAY, *layout)
    assert len(read_metrics(tmp_path / "run")) == 3
    assert (tmp_path / "run" / "checkpoint-3" / "manifest.json").exists()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_blocked_rank_is_reported_on_ray(tmp_path, e2e_cache):
    """As on the local launcher (tests/e2e/test_resume.py): rank 0 blocks in step 5's update,
    rank 1 waits in its collective; the report names both, and the run stops with the error of
    the collective that timed out."""
    run_dir = tmp_path / "hung"
    hung = run(run_dir, *RAY, *HANG_AT_STEP_5, check=False)
    err = assert_hang_reported(run_dir, hung)
    assert "(node " in err and "rerun the same command to continue from step 3" in err, err
