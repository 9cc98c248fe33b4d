"""``posttrain export-hf RUN_DIR/checkpoint-N OUT [--role critic]``: a checkpoint's policy (or
critic, a value model) as a loadable HF directory.

The trainer's strategy wrote the checkpoint in its own format (DCP, dist_checkpointing), so the
export starts that strategy's worker group with the run's saved workflow, loads the checkpoint
and calls the strategy's ``posttrain_export_hf`` hook.
"""

from __future__ import annotations

import os
import shutil

import yaml

from posttrain.checkpoint.manifest import verify
from posttrain.config.report import ErrorReport
from posttrain.config.workflow import build_workflow
from posttrain.errors import CheckpointError, UserError
from posttrain.paths import display_path
from posttrain.trainer.run import WORKFLOW_COPY, group_spec, make_launcher, resolve_device


def export_checkpoint_to_hf(
    checkpoint_dir: str, output: str, host, console, role: str = "actor_train"
) -> str:
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise UserError(f"checkpoint directory not found: {display_path(checkpoint_dir)}")
    manifest = verify(checkpoint_dir)
    if role not in manifest.roles:
        raise CheckpointError(
            f"{display_path(checkpoint_dir)} holds no {role} state "
            f"(it holds {', '.join(manifest.roles)})"
        )
    run_dir = os.path.dirname(checkpoint_dir)
    copy = os.path.join(run_dir, WORKFLOW_COPY)
    try:
        with open(copy, encoding="utf-8") as f:
            saved = yaml.safe_load(f)
    except OSError as exc:
        raise CheckpointError(
            f"{display_path(copy)} is needed to rebuild the trainer and cannot be read ({exc})"
        ) from None
    raw = dict(saved["workflow"])
    raw.pop("base_dir", None)
    report = ErrorReport()
    workflow, report = build_workflow(raw, host, report, base_dir=saved["run"]["base_dir"])
    report.raise_if_errors(display_path(copy))
    role_name, role = role, getattr(workflow, role)
    layout = manifest.roles[role_name]
    if role.num_ranks != layout["world_size"]:
        raise CheckpointError(
            f"{display_path(copy)} maps {role.num_ranks} ranks but the checkpoint was "
            f"saved by {layout['world_size']}"
        )
    output = os.path.abspath(output)
    staging = output + ".tmp-export"
    shutil.rmtree(staging, ignore_errors=True)
    launcher = make_launcher(workflow, [(role_name,)])
    try:
        group = launcher.start_group(
            group_spec(workflow, role_name, role, run_dir, resolve_device(workflow))
        )
        group.call("load_checkpoint", os.path.join(checkpoint_dir, role_name))
        group.call("export_hf", staging)
    finally:
        launcher.shutdown()
    if os.path.exists(output):
        shutil.rmtree(output)
    os.rename(staging, output)
    console.print(
        f"exported {role_name} of {display_path(checkpoint_dir)} (step {manifest.step}) "
        f"to {display_path(output)}"
    )
    return output
