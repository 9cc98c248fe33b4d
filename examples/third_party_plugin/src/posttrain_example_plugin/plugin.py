"""The entry-point module of posttrain-example-plugin (cheap to import: no torch, no engine).

It implements four hooks:

* ``posttrain_add_reward_functions``: the named reward ``digit_match``;
* ``posttrain_add_advantage_estimators``: the advantage estimator ``sign``;
* ``posttrain_sync_weights`` as a hook wrapper: times every weight sync and appends one JSON line
  per sync to ``$POSTTRAIN_EXAMPLE_TIMINGS_DIR/weight_sync_times.jsonl`` (default: the current
  directory);
* ``posttrain_add_cli_commands``: the subcommand ``posttrain example-hello``;
* ``posttrain_step_metrics``: ``example/syncs`` (weight syncs timed so far, this run and the runs
  it resumed) and ``time/example_sync`` (seconds of the step's syncs, shown with the phases);
* ``posttrain_checkpoint_files`` / ``posttrain_restore_checkpoint_files``: the timings travel in
  every checkpoint as ``example/sync_times.json`` and come back on resume, so the count goes on;
* ``posttrain_add_environments``: ``guess_digit``, a multi-turn environment (higher/lower hints);
* ``posttrain_add_loggers``: the logger ``csv`` (chosen metrics, a row per step, in a CSV file).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Generator, Mapping
from typing import Any

from posttrain import AdvantageEstimator, EnvironmentSpec, LoggerSpec, WeightTransport, hookimpl
from posttrain_example_plugin.advantages import sign_advantages
from posttrain_example_plugin.csv_logger import CsvOptions

TIMINGS_ENV = "POSTTRAIN_EXAMPLE_TIMINGS_DIR"
TIMINGS_FILE = "weight_sync_times.jsonl"

# Every sync timed in this process: {"sync": n, "seconds": s, "bytes": b, "buckets": k}.
SYNC_TIMES: list[dict[str, float]] = []


@hookimpl
def posttrain_add_reward_functions() -> dict[str, str]:
    return {"digit_match": "posttrain_example_plugin.rewards:digit_match"}


@hookimpl
def posttrain_add_advantage_estimators() -> dict[str, AdvantageEstimator]:
    return {"sign": AdvantageEstimator(estimate=sign_advantages, min_group_size=2)}


@hookimpl
def posttrain_add_environments() -> dict[str, EnvironmentSpec]:
    # The factory is imported when a run uses it: this module stays cheap.
    return {
        "guess_digit": EnvironmentSpec(
            factory="posttrain_example_plugin.guess:GuessDigit",
            description="guess a digit; wrong guesses get a + (higher) or - (lower) hint",
        )
    }


@hookimpl
def posttrain_add_loggers() -> dict[str, LoggerSpec]:
    # "module:attr": the logger's module is imported when a run names it.
    return {
        "csv": LoggerSpec(
            factory="posttrain_example_plugin.csv_logger:CsvLogger",
            config_class=CsvOptions,
            description="chosen metrics, one row per step, in RUN_DIR/metrics.csv",
        )
    }


def timings_path() -> str:
    return os.path.join(os.environ.get(TIMINGS_ENV) or os.getcwd(), TIMINGS_FILE)


@hookimpl(wrapper=True)
def posttrain_sync_weights(
    source: object, target: object, transport: WeightTransport
) -> Generator[None, dict[str, Any] | None, dict[str, Any] | None]:
    start = time.perf_counter()
    result = yield
    record = {"sync": len(SYNC_TIMES) + 1, "seconds": time.perf_counter() - start}
    if isinstance(result, dict):
        record.update({k: result[k] for k in ("bytes", "buckets") if k in result})
    SYNC_TIMES.append(record)
    path = timings_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return result  # unchanged


@hookimpl
def posttrain_add_cli_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    parser = subparsers.add_parser("example-hello", help="say hello from the example plugin")
    parser.add_argument("--name", default="world", help="who to greet")
    parser.set_defaults(handler=_hello)


def _hello(args: argparse.Namespace, host: object = None) -> int:
    print(f"hello, {args.name}, from posttrain-example-plugin")
    return 0


CHECKPOINT_FILE = "example/sync_times.json"
# Syncs timed up to the previous step: the step's metrics cover the syncs after it.
_reported = 0


@hookimpl
def posttrain_step_metrics(step: int, metrics: Mapping[str, float]) -> dict[str, float]:
    global _reported
    this_step = SYNC_TIMES[_reported:]
    _reported = len(SYNC_TIMES)
    return {
        "example/syncs": float(len(SYNC_TIMES)),
        "time/example_sync": sum(r["seconds"] for r in this_step),
    }


@hookimpl
def posttrain_checkpoint_files(step: int, run_dir: str) -> dict[str, bytes]:
    return {CHECKPOINT_FILE: json.dumps(SYNC_TIMES).encode()}


@hookimpl
def posttrain_restore_checkpoint_files(step: int, files: dict[str, bytes]) -> None:
    global _reported
    if CHECKPOINT_FILE in files:
        SYNC_TIMES[:] = json.loads(files[CHECKPOINT_FILE])
        _reported = len(SYNC_TIMES)
