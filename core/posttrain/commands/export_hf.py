"""``posttrain export-hf RUN_DIR/checkpoint-N OUT [--role critic] [--merge]``: a checkpoint's
policy (or critic, a value model) as a loadable HF directory; of a LoRA run, its adapter in peft's
format and, with ``--merge``, the merged model.

The trainer's strategy wrote the checkpoint in its own format (DCP, dist_checkpointing), so the
export starts that strategy's worker group with the workflow the checkpoint records (the one
that saved it), loads the checkpoint and calls the strategy's ``posttrain_export_hf`` hook.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any

from posttrain.checkpoint.manifest import verify
from posttrain.checkpoint.record import RECORD, checkpoint_record, read_record
from posttrain.config.report import ErrorReport
from posttrain.errors import CheckpointError, UserError
from posttrain.launch.plan import group_spec, make_launcher, resolve_device
from posttrain.loading.workflow import build_workflow
from posttrain.paths import display_path

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.config.sections import RoleConfig
    from posttrain.host.plugin_host import PluginHost


def export_checkpoint_to_hf(
    checkpoint_dir: str,
    output: str,
    host: PluginHost,
    console: Console,
    role: str = "actor_train",
    merge: bool = False,
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
    record_path, record = _saved_workflow(checkpoint_dir, run_dir)
    raw = dict(record["workflow"])
    raw.pop("base_dir", None)
    report = ErrorReport()
    workflow, report = build_workflow(raw, host, report, base_dir=record["run"]["base_dir"])
    report.raise_if_errors(display_path(record_path))
    assert workflow is not None  # only a report with errors comes without a workflow
    role_name = role
    role_config: RoleConfig = getattr(workflow, role_name)
    layout = manifest.roles[role_name]
    if merge and role_config.model_args.lora is None:
        raise UserError(
            f"--merge: {display_path(checkpoint_dir)} holds full weights ({role_name} trained "
            "without model_args.lora), which are exported merged already; drop --merge"
        )
    if role_config.num_ranks != layout["world_size"]:
        # Only a checkpoint without a record of its own gets here: the run directory's
        # workflow.yaml is a later run's, on another layout.
        raise CheckpointError(
            f"{display_path(record_path)} maps {role_config.num_ranks} ranks to {role_name} but "
            f"{display_path(checkpoint_dir)} was saved by {layout['world_size']}: that file is "
            "a later run's. Export with a copy of the run directory whose workflow.yaml maps "
            f"{layout['world_size']} ranks to {role_name} (the workflow that saved it)"
        )
    output = os.path.abspath(output)
    staging = output + ".tmp-export"
    shutil.rmtree(staging, ignore_errors=True)
    launcher = make_launcher(workflow, [(role_name,)])
    try:
        group = launcher.start_group(
            group_spec(workflow, role_name, role_config, run_dir, resolve_device(workflow))
        )
        group.call("load_checkpoint", os.path.join(checkpoint_dir, role_name))
        group.call("export_hf", staging, merge)
    finally:
        launcher.shutdown()
    _readable_as_umask_allows(staging)
    if os.path.exists(output):
        shutil.rmtree(output)
    os.rename(staging, output)
    console.print(
        f"exported {role_name} of {display_path(checkpoint_dir)} (step {manifest.step}) "
        f"to {display_path(output)}"
    )
    return output


def _saved_workflow(checkpoint_dir: str, run_dir: str) -> tuple[str, dict[str, Any]]:
    """The workflow that saved the checkpoint: its own record, or, for a checkpoint saved
    before checkpoints had one, the run directory's copy."""
    own = checkpoint_record(checkpoint_dir)
    if own is not None:
        return os.path.join(checkpoint_dir, RECORD), own
    copy = os.path.join(run_dir, RECORD)
    if not os.path.isfile(copy):
        raise CheckpointError(
            f"{display_path(checkpoint_dir)} has no {RECORD} of its own (it predates them) and "
            f"{display_path(copy)}, needed to rebuild the trainer, is missing"
        )
    return copy, read_record(copy)


def _readable_as_umask_allows(directory: str) -> None:
    """Give every exported file the mode a new file gets here (the umask's): some writers make
    their files private (0600), which the other files of an HF directory are not."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(directory):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)
