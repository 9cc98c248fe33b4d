"""Helpers for end-to-end runs of ``posttrain run`` as a separate process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def posttrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", *args]


def run_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def e2e_cache(posttrain_cache):
    return posttrain_cache
