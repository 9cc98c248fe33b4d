"""Resuming a run: which checkpoint, whether it may be resumed by this workflow, and what a
rerun of an interrupted run would do."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.checkpoint import manager
from posttrain.checkpoint.manifest import Manifest
from posttrain.checkpoint.record import checkpoint_record, run_changes
from posttrain.errors import CheckpointError, DamagedCheckpoint, UserError
from posttrain.paths import display_path

if TYPE_CHECKING:
    from collections.abc import Callable

    from posttrain.config.sections import Workflow

SHOWN_CHANGES = 12


@attrs.frozen
class Resumable:
    """A checkpoint verified for a resume: its files, its driver state, its manifest."""

    path: str
    manifest: Manifest
    state: dict[str, Any]


def checkpoint_to_resume(workflow: Workflow, run_dir: str) -> str | None:
    """The checkpoint ``trainer.resume`` names, if any (nothing is read or written)."""
    resume = workflow.trainer.resume
    if resume == "auto":
        return manager.latest_checkpoint(run_dir)
    if resume != "never":
        return resume if os.path.isabs(resume) else os.path.join(workflow.base_dir, resume)
    return None


def resumable(
    workflow: Workflow, run_dir: str, requested: Workflow, say: Callable[..., None]
) -> Resumable | None:
    """The checkpoint to resume, verified (``requested``: the workflow as written, which the
    checkpoint's record is compared with). A damaged latest checkpoint under ``resume: auto``
    stops the run naming the file, or with ``trainer.resume_fallback`` gives way to the latest
    whole one before it (``say`` tells which and why)."""
    path = checkpoint_to_resume(workflow, run_dir)
    if path is None:
        return None
    fallback = workflow.trainer.resume == "auto" and workflow.trainer.resume_fallback
    try:
        return verified(path, requested)
    except DamagedCheckpoint as exc:
        if not fallback:
            if workflow.trainer.resume == "auto":
                exc.args = (
                    f"{exc}; to resume from the latest whole checkpoint before it, set "
                    "trainer.resume_fallback: true (--set trainer.resume_fallback=true)",
                )
            raise
        damaged = exc
    # (under resume: auto the damaged one is the latest)
    for _, earlier in reversed(manager.checkpoint_dirs(run_dir)[:-1]):
        try:
            checkpoint = verified(earlier, requested)
        except DamagedCheckpoint as exc:
            say(f"warning: {exc}", markup=False)
            continue
        say(
            f"warning: {damaged}\nresuming from {display_path(earlier)} instead "
            "(trainer.resume_fallback)",
            markup=False,
        )
        return checkpoint
    raise CheckpointError(f"{damaged}, and no checkpoint before it is whole")


def verified(path: str, workflow: Workflow) -> Resumable:
    """The checkpoint at ``path``, its files checked against its manifest and the workflow it
    records against ``workflow``: a resume that would change the run is refused, unless
    ``trainer.allow_resume_changes``."""
    manifest, state = manager.load_driver_state(path)
    for role in manifest.roles:
        if role not in workflow.roles():
            raise UserError(
                f"checkpoint {display_path(path)} holds role '{role}' that this workflow lacks"
            )
    record = checkpoint_record(path)
    changes = run_changes(record["workflow"], workflow) if record else []
    if changes and not workflow.trainer.allow_resume_changes:
        shown = "\n".join(f"  {c}" for c in changes[:SHOWN_CHANGES])
        if len(changes) > SHOWN_CHANGES:
            shown += f"\n  ... and {len(changes) - SHOWN_CHANGES} more"
        raise CheckpointError(
            f"{display_path(path)} was saved by a different run; resuming it would change "
            f"what that run is:\n{shown}\n"
            "write this run elsewhere (--set trainer.output_dir=runs/NEW), or resume with "
            "these changes (--set trainer.allow_resume_changes=true)"
        )
    return Resumable(path, manifest, state)


def rerun_hint(run_dir: str, last_step: int, resume_setting: str) -> str:
    """What rerunning a run interrupted after ``last_step`` does: from which checkpoint,
    redoing which steps."""
    latest = manager.latest_checkpoint(run_dir)
    if latest is None:
        return f"after step {last_step}, with no checkpoint yet: a rerun starts over at step 1"
    saved = Manifest.read(latest).step
    rerun = (
        "rerun the same command"
        if resume_setting == "auto"
        else "rerun with --set trainer.resume=auto"
    )
    redo = ""
    if last_step == saved + 1:
        redo = f", redoing step {last_step}"
    elif last_step > saved:
        redo = f", redoing steps {saved + 1}-{last_step}"
    return (
        f"after step {last_step}; the last complete checkpoint is {display_path(latest)}: "
        f"{rerun} to continue from step {saved}{redo}"
    )
