"""Killed anywhere, the rerun is the same run: a property test over random kill points.

Each chain is a run killed again and again, each time at a point drawn at random (the driver, a
trainer rank or a rollout rank; at the start of a step, inside a generation with partial samples
in flight, inside a weight sync, while a background save writes, a moment after a step), each
kill followed by a rerun with ``trainer.resume: auto`` that the next kill interrupts in turn. The
last rerun goes to the end. Then:

- every step's figures equal the uninterrupted run's, bitwise (rewards, KL, losses, lengths),
  and so does what it trained on: the digest of the step's prompts and samples
  (``batch_digest_plugin``), so no sample was dropped or trained twice;
- with partial rollouts, whose samples depend on which segment a weight sync lands between
  (timing), the prompts of every step and the number of samples equal the uninterrupted run's;
- every checkpoint directory a kill left verifies in full (no checkpoint looks complete that
  is not), and no process of a killed run is left behind.

Four chains, 20 kill points in all per run of the suite: a synchronous hybrid run with
background saves (8), an asynchronous disaggregated one with partial rollouts (6), a multi-turn
environment (3), and the Ray launcher (3). The draw is seeded: ``POSTTRAIN_KILL_SEED`` picks
another (default 0), and ``POSTTRAIN_KILL_SCALE=K`` draws K times as many kill points per chain,
for a longer, nightly-style run. A failing chain prints its seed and every fault it injected.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from conftest import QUICKSTART, posttrain_cmd, read_metrics, run_env, small_run

CORE_TESTS = Path(__file__).resolve().parents[1] / "core"
SEED = int(os.environ.get("POSTTRAIN_KILL_SEED", "0"))
SCALE = int(os.environ.get("POSTTRAIN_KILL_SCALE", "1"))
# Figures of the clock: the rest of a step's metrics is the run's own.
CLOCK = ("time/", "idle/", "async/", "rank_time/", "memory/", "perf/", "driver/", "checkpoint/")


@attrs.frozen(kw_only=True)
class Chain:
    """A workflow killed ``kills`` times. ``points(rng, done, steps)`` draws one fault (a
    ``POSTTRAIN_FAULTS`` entry) for a launch that resumes after step ``done`` of ``steps``."""

    name: str
    overrides: tuple[str, ...]
    steps: int
    kills: int
    points: Callable[[random.Random, int, int], str]
    workflow: Path = QUICKSTART
    plugins: tuple[str, ...] = ()  # the workflow's own, beside the fault kit and the digests
    bitwise: bool = True  # False: partial rollouts, compared by what was trained on
    ray: bool = False


def _sets(**values: object) -> tuple[str, ...]:
    return tuple(arg for key, value in values.items() for arg in ("--set", f"{key}={value}"))


def common(chain: Chain, faults: str) -> tuple[str, ...]:
    plugins = ", ".join(["posttrain.testing.faults", "batch_digest_plugin", *chain.plugins])
    sets = (*small_run(max_steps=chain.steps, save_steps=1), *_sets(plugins=f"[{plugins}]"))
    if chain.ray and faults:  # (the local launcher hands the driver's environment down)
        sets += _sets(**{"cluster.runtime_env.env_vars.POSTTRAIN_FAULTS": faults})
    return sets


def _moment(rng: random.Random) -> str:
    return f"{rng.choice([0, 0.02, 0.1, 0.3])}"


# Every point drawn lands before the run could end: a call counted from the launch's start is
# one each remaining step makes; a kill some time after a call, or after a step is logged, aims
# at a step that another follows (after the last one the run may be gone first).


def _later(rng: random.Random, done: int, left: int) -> list[str]:
    """Kills a moment after the driver logged a step, or after a rank's call of a step, when a
    step is left after it; else the driver killed as the last step is logged."""
    if left < 2:
        return [f"kill_driver:{done + 1}"]
    m = rng.randint(1, min(2, left - 1))
    return [
        f"kill_driver:{done + m}/after_s={_moment(rng)}",
        f"kill_rank:{m}/phase=save/after_s={_moment(rng)}",
        f"kill_rank:{m}/phase=train/after_s={_moment(rng)}",
    ]


def synchronous_points(rng: random.Random, done: int, steps: int) -> str:
    """Two ranks, each hosting the trainer, the rollout engine and the reference; a step
    generates, trains and saves once, and a weight sync follows every step but the last."""
    left = steps - done
    n = rng.randint(1, min(2, left))
    rank = rng.randint(0, 1)
    choices = [
        f"kill_rank:{n}/rank={rank}",
        f"kill_rank:{n}/rank={rank}/phase=generate",
        f"kill_rank:{n}/rank={rank}/phase=save",
        *(
            f"{point}/rank={rank}" if point.startswith("kill_rank") else point
            for point in _later(rng, done, left)
        ),
    ]
    if left >= 2:
        choices.append(f"kill_rank:1/rank={rank}/phase=sync")
    return rng.choice(choices)


def asynchronous_points(rng: random.Random, done: int, steps: int) -> str:
    """The trainer (and reference) on one process, the rollout engine on the other; partial
    rollouts of 4 one-token segments, so a generation call is a segment: from the second on,
    samples are in flight. A resumed launch first trains on the batch its checkpoint kept,
    so it generates the batches of all remaining steps but one: four calls each."""
    left = steps - done
    n = rng.randint(1, min(2, left))
    choices = [f"kill_rank:{n}/role=actor_train", *_later(rng, done, left)]
    if left >= 2:
        choices.append(f"kill_rank:{rng.randint(1, min(2, left - 1))}/phase=sync/role=actor_infer")
    if left >= 3:
        choices.append(f"kill_rank:{rng.randint(2, 6)}/phase=generate/role=actor_infer")
    return rng.choice(choices)


def environment_points(rng: random.Random, done: int, steps: int) -> str:
    """One rank; each episode takes two model turns (generation calls), an environment step
    between them: a kill at an odd call lands between the turns of a step's episodes."""
    left = steps - done
    n = rng.randint(1, min(2, left))
    return rng.choice(
        [
            f"kill_rank:{rng.randint(1, min(3, 2 * left))}/phase=generate",
            f"kill_rank:{n}",
            *_later(rng, done, left)[:1],
        ]
    )


def ray_points(rng: random.Random, done: int, steps: int) -> str:
    left = steps - done
    n = rng.randint(1, min(2, left))
    rank = rng.randint(0, 1)
    return rng.choice(
        [
            f"kill_rank:{n}/rank={rank}",
            f"kill_rank:{n}/rank={rank}/phase=generate",
            *_later(rng, done, left)[:1],
        ]
    )


ENVIRONMENT_WORKFLOW = """\
model_args: {model_name_or_path: preset:tiny-qwen2, dtype: fp32}
data: {path: data.jsonl}
plugins: [env_support]                 # tests/core/env_support.py: scripted turns
algorithm: {name: grpo, group_size: 4, rollout_batch_size: 4}
environment:
  name: countdown                      # a tool's answer after each turn, done after the 2nd
  kwargs: {turns: 2, observation: " ok", reward: digits}  # a turn's reward: the digits in it
  reward: episode
  max_turns: 3
  max_total_tokens: 24
actor_train:
  strategy_args: {strategy_name: fsdp2_train, strategy_config: {}}
  device_mapping: [0]
  training_args: {learning_rate: 1.0e-3, per_device_train_batch_size: 16}
actor_infer:
  strategy_args: {strategy_name: hf_infer}
  device_mapping: [0]
  generating_args: {max_new_tokens: 3, temperature: 1.0}
reward: {function: exact_match}
trainer: {max_steps: 5, output_dir: run, logger: [jsonl], progress: false, seed: 42}
"""


def _chains() -> list[Chain]:
    asynchronous = _sets(
        **{
            "algorithm.max_staleness": 1,
            "actor_train.device_mapping": "[0]",
            "reference.device_mapping": "[0]",
            "actor_infer.device_mapping": "[1]",
            "algorithm.partial_rollout": "true",
            "algorithm.partial_rollout_segment_tokens": 1,
            "actor_infer.generating_args.max_new_tokens": 4,
            "actor_infer.generating_args.ignore_eos": "true",
        }
    )
    ray = _sets(**{"cluster.launcher": "ray", "cluster.address": "auto"})
    return [
        Chain(name="synchronous", overrides=(), steps=10, kills=8, points=synchronous_points),
        Chain(
            name="asynchronous-partial",
            overrides=asynchronous,
            steps=9,
            kills=6,
            points=asynchronous_points,
            bitwise=False,
        ),
        Chain(
            name="environment",
            overrides=(),
            steps=6,
            kills=3,
            points=environment_points,
            workflow=Path("workflow.yaml"),  # written into the test's directory
            plugins=("env_support",),
        ),
        Chain(name="ray", overrides=ray, steps=6, kills=3, points=ray_points, ray=True),
    ]


CHAINS = {chain.name: chain for chain in _chains()}


def launch(
    chain: Chain, run_dir: Path, cwd: Path, env: dict[str, str], faults: str = ""
) -> subprocess.CompletedProcess:
    """One ``posttrain run`` of the chain's workflow, in a session of its own."""
    overrides = (*chain.overrides, *common(chain, faults))
    command = posttrain_cmd(
        "run", str(chain.workflow), *overrides, "--set", f"trainer.output_dir={run_dir}"
    )
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env={**env, "POSTTRAIN_FAULTS": faults},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if not chain.ray:  # Ray's workers belong to the cluster, not to the run's session
        assert_session_gone(proc.pid, faults)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def assert_session_gone(session: int, faults: str, deadline_s: float = 15) -> None:
    """No process of the run's session outlives it by more than ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        members = [pid for pid, sid in _sessions() if sid == session]
        if not members:
            return
        if time.monotonic() > end:
            raise AssertionError(f"{faults}: processes {members} outlived the run")
        time.sleep(0.2)


def _sessions() -> list[tuple[int, int]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if fields[0] not in ("Z", "X"):
            found.append((int(entry.name), int(fields[3])))
    return found


def complete_steps(run_dir: Path) -> list[int]:
    """Steps of the checkpoints a resume may use; each verifies in full."""
    from posttrain.checkpoint.manifest import verify

    steps = []
    for path in run_dir.glob("checkpoint-*"):
        verify(str(path))  # never a directory that looks complete but is not
        steps.append(int(path.name.split("-")[1]))
    return sorted(steps)


def figures(run_dir: Path, bitwise: bool) -> list[dict]:
    """Each step's figures but the clock's; with partial rollouts, what every step trained on
    that timing does not decide (its prompts, how many samples, their staleness bound)."""
    metrics = read_metrics(run_dir)
    if bitwise:
        return [{k: v for k, v in m.items() if not k.startswith(CLOCK)} for m in metrics]
    kept = ("step", "actor/data_prompts_digest", "actor/data_samples", "async/staleness")
    return [{k: m[k] for k in kept} for m in metrics]


def run_chain(chain: Chain, tmp_path: Path, env: dict[str, str]) -> None:
    cwd = tmp_path
    if chain.name == "environment":
        (tmp_path / "workflow.yaml").write_text(textwrap.dedent(ENVIRONMENT_WORKFLOW))
        records = [{"prompt": f"0+{a}=", "answer": str(a)} for a in range(8)]
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    uninterrupted = launch(chain, tmp_path / "uninterrupted", cwd, env)
    assert uninterrupted.returncode == 0, (
        uninterrupted.stdout[-3000:] + uninterrupted.stderr[-3000:]
    )

    rng = random.Random(f"{SEED}:{chain.name}")
    run_dir = tmp_path / "killed"
    injected: list[str] = []
    for _ in range(chain.kills * SCALE):
        done = (complete_steps(run_dir) or [0])[-1] if run_dir.exists() else 0
        if done == chain.steps:
            break  # (only with a large POSTTRAIN_KILL_SCALE)
        fault = chain.points(rng, done, chain.steps)
        injected.append(f"{fault} (after step {done})")
        killed = launch(chain, run_dir, cwd, env, faults=fault)
        output = tmp_path / f"launch-{len(injected)}.txt"  # (kept for a failure's reader)
        output.write_text(f"{fault}\n--- stdout\n{killed.stdout}\n--- stderr\n{killed.stderr}")
        where = f"seed {SEED}, {chain.name}: {injected}, output in {output}\n"
        assert killed.returncode != 0, where + killed.stdout[-2000:]
        assert "faults: " in killed.stdout + killed.stderr + _rank_logs(run_dir), where
        assert "Traceback" not in killed.stderr, where + killed.stderr[-3000:]
    assert len(injected) >= chain.kills, injected

    rerun = launch(chain, run_dir, cwd, env)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, f"seed {SEED}, {chain.name}: {injected}\n" + out[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, chain.steps + 1))
    assert [m["step"] for m in read_metrics(run_dir, "history.jsonl")] == list(
        range(1, chain.steps + 1)
    )
    assert figures(run_dir, chain.bitwise) == figures(tmp_path / "uninterrupted", chain.bitwise), (
        f"seed {SEED}, {chain.name}: {injected}"
    )


def _rank_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", ["synchronous", "asynchronous-partial", "environment"])
def test_killed_at_random_points_the_reruns_are_the_same_run(name, tmp_path, e2e_cache):
    env = run_env()
    env["PYTHONPATH"] = os.pathsep.join([str(CORE_TESTS), env["PYTHONPATH"]])
    run_chain(CHAINS[name], tmp_path, env)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_killed_at_random_points_under_ray_the_reruns_are_the_same_run(tmp_path, e2e_cache):
    pytest.importorskip("ray")
    from test_ray import free_port

    temp = tempfile.mkdtemp(prefix="ptrk-", dir="/tmp")
    port = free_port()
    env = run_env(RAY_AUTH_MODE="disabled", RAY_ADDRESS=f"127.0.0.1:{port}")
    ray_bin = str(Path(sys.executable).parent / "ray")
    start = [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=4"]
    start += ["--include-dashboard=false", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    try:
        run_chain(CHAINS["ray"], tmp_path, env)
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_the_chains_draw_at_least_20_kill_points():
    assert sum(chain.kills for chain in CHAINS.values()) >= 20
    # Every kind of point is in the draw: each process, each phase.
    drawn = set()
    for chain in CHAINS.values():
        rng = random.Random(0)
        for done in range(chain.steps - 1):
            for _ in range(50):
                drawn.add(re.sub(r"[:=][\d.]+", "", chain.points(rng, done, chain.steps)))
    kinds = {d.split("/")[0] for d in drawn}
    phases = {p.split("=")[0] for d in drawn for p in d.split("/")[1:] if p.startswith("phase")}
    assert kinds == {"kill_rank", "kill_driver"}
    assert {"phase"} <= phases
    assert any("generate" in d for d in drawn) and any("sync" in d for d in drawn)
    assert any("save" in d for d in drawn)
