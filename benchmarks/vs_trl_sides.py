"""How benchmarks/vs_trl.py runs each side: a subprocess whose per-step JSONL lines are read as
they are written (their arrival times give posttrain's step ends), one after the other, never at
once. posttrain runs a workflow through ``posttrain run`` in this environment; TRL runs
benchmarks/trl_grpo_side.py with TRL's Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, posttrain_run_command

TRL_SIDE = REPO / "benchmarks" / "trl_grpo_side.py"


def default_trl_python() -> str:
    """TRL's own virtual environment (benchmarks/trl_env.sh .venv-trl) where there is one, else
    this interpreter (a machine where TRL imports beside posttrain, e.g. from carried wheels)."""
    venv = REPO / ".venv-trl" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def trl_version(trl_python: str) -> str:
    """TRL's version in ``trl_python``; ends the benchmark when TRL does not import there."""
    proc = subprocess.run(
        [trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    if proc.returncode:
        sys.exit(
            f"TRL does not import with {trl_python} (make a venv with benchmarks/trl_env.sh "
            f".venv-trl, or pass --trl-python):\n{proc.stderr[-2000:]}"
        )
    return proc.stdout.strip()


def side_env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def follow(proc: subprocess.Popen, path: Path, poll_s: float = 0.005) -> list[tuple[float, dict]]:
    """Lines of a JSONL file as the process appends them, each with its arrival (time.time())."""
    lines: list[tuple[float, dict]] = []
    buf = ""
    handle = None
    while True:
        running = proc.poll() is None
        if handle is None and path.exists():
            handle = open(path, encoding="utf-8")  # noqa: SIM115
        if handle is not None:
            chunk = handle.read()
            now = time.time()
            if chunk:
                buf += chunk
                *complete, buf = buf.split("\n")
                lines += [(now, json.loads(line)) for line in complete if line.strip()]
        if not running:
            break
        time.sleep(poll_s)
    if handle is not None:
        handle.close()
    return lines


def run_side(name: str, cmd: list[str], steps_file: Path, log: Path) -> tuple[float, float, list]:
    with open(log, "w") as out:
        launch = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=side_env(), cwd=REPO)
        lines = follow(proc, steps_file)
        done = time.time()
    if proc.returncode:
        tail = log.read_text()[-3000:]
        sys.exit(f"{name} side failed (exit {proc.returncode}); log {log}:\n{tail}")
    return launch, done, lines


def run_posttrain(work: Path, workflow: Path, overrides: list[str]) -> dict:
    """``posttrain run workflow`` into ``work``/posttrain_run with ``--set`` ``overrides``."""
    run_dir = work / "posttrain_run"
    cmd = posttrain_run_command(workflow, [f"trainer.output_dir={run_dir}", *overrides])
    launch, done, lines = run_side(
        "posttrain", cmd, run_dir / "metrics.jsonl", work / "posttrain.log"
    )
    rows = []
    for arrived, m in lines:
        # A step's metrics line is written as the step ends; time/step is the step's own time.
        rows.append(
            {
                "reward": m["reward/mean"],
                "begin": arrived - m["time/step"],
                "end": arrived,
                "own": m["time/step"],
                "length": m["response/length_mean"],
                "phases": {k: v for k, v in m.items() if k.startswith("time/")},
            }
        )
    return {"launch": launch, "done": done, "rows": rows, "cmd": cmd}


def run_trl(work: Path, trl_python: str, side_args: list[str]) -> dict:
    """benchmarks/trl_grpo_side.py with ``side_args``, its steps and output in ``work``."""
    steps_file = work / "trl_steps.jsonl"
    cmd = [
        trl_python,
        str(TRL_SIDE),
        "--out",
        str(steps_file),
        "--output-dir",
        str(work / "trl_output"),
        *side_args,
    ]
    launch, done, lines = run_side("TRL", cmd, steps_file, work / "trl.log")
    rows = [
        {
            "reward": r["reward"],
            "begin": r["begin"],
            "end": r["end"],
            "own": r["end"] - r["begin"],
            "length": r["length"],
        }
        for _, r in lines
    ]
    return {"launch": launch, "done": done, "rows": rows, "cmd": cmd}
