"""What a checkpoint records of the run that saved it.

Every checkpoint holds ``workflow.yaml``: the workflow as that run ran it (strategy configs
included) and where it came from, listed in the manifest like any other file. Readers rebuild
what saved the checkpoint from it (``posttrain export-hf``), never from the run directory's
latest ``workflow.yaml``, which a later run on another layout rewrites. A resume compares it
with the workflow about to run and refuses a different run (:func:`run_changes`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs
import yaml

from posttrain.errors import CheckpointError
from posttrain.paths import display_path

if TYPE_CHECKING:
    from posttrain.config.sections import Workflow

RECORD = "workflow.yaml"

# What a resumed run may change: where and how it runs, how long, how it logs and saves. Every
# other key (algorithm, data, model, roles and their devices, rewards, environment, seed)
# defines the run, and a change there is refused unless trainer.allow_resume_changes is set.
# Evaluation only reads the policy, with seeds of its own: it changes nothing of the run.
_RUN_NEUTRAL = {"cluster", "plugins", "base_dir", "evaluation"}
_RUN_NEUTRAL_TRAINER = {
    "max_steps",
    "save_steps",
    "save_final",
    "save_total_limit",
    "async_save",
    "output_dir",
    "logger",
    "logger_args",
    "resume",
    "allow_resume_changes",
    "resume_fallback",
    "weight_sync_bucket_mb",
    "weight_sync_verify",
    "progress",
}


def plain(value: Any) -> Any:
    """The workflow (or any part of it) as plain YAML data, strategy configs included."""
    if attrs.has(type(value)):
        return {f.name: plain(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def workflow_record(workflow: Workflow, source: str) -> bytes:
    """The record of ``workflow`` (read from the file ``source``), as saved in checkpoints and
    as the run directory's ``workflow.yaml``."""
    run = {"source": source, "base_dir": workflow.base_dir}
    text = yaml.safe_dump({"run": run, "workflow": plain(workflow)}, sort_keys=False)
    return text.encode()


def read_record(path: str) -> dict[str, Any]:
    """A record written by :func:`workflow_record` (``path``: the file)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{display_path(path)} cannot be read ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("workflow"), dict):
        raise CheckpointError(f"{display_path(path)} is not a workflow record")
    return record


def checkpoint_record(checkpoint_dir: str) -> dict[str, Any] | None:
    """The checkpoint's own record; None for a checkpoint saved before checkpoints had one."""
    path = os.path.join(checkpoint_dir, RECORD)
    return read_record(path) if os.path.isfile(path) else None


def run_changes(saved: dict[str, Any], workflow: Workflow) -> list[str]:
    """``key: old -> new`` for every key that defines the run and differs between the saved
    workflow (a record's ``workflow``) and ``workflow``."""
    current = yaml.safe_load(yaml.safe_dump(plain(workflow)))
    changes: list[str] = []
    for section in sorted(set(saved) | set(current)):
        if section in _RUN_NEUTRAL:
            continue
        old, new = saved.get(section), current.get(section)
        if section == "trainer":
            old, new = _without(old, _RUN_NEUTRAL_TRAINER), _without(new, _RUN_NEUTRAL_TRAINER)
        _diff(section, old, new, changes)
    return changes


def _without(section: Any, keys: set[str]) -> Any:
    if not isinstance(section, dict):
        return section
    return {k: v for k, v in section.items() if k not in keys}


def _diff(path: str, old: Any, new: Any, out: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            _diff(f"{path}.{key}", old.get(key), new.get(key), out)
    elif old != new:
        out.append(f"{path}: {_short(old)} -> {_short(new)}")


def _short(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    text = text.removesuffix("...").strip()
    return text if len(text) <= 60 else text[:57] + "..."
