"""``posttrain eval WORKFLOW --checkpoint PATH|latest [--out FILE]``: a checkpoint's policy scored
on the workflow's held-out datasets, without training; the metrics go to a JSON report.

It reuses the run's machinery: the workflow's roles start as for a run (their logs under
``RUN_DIR/eval/``), the checkpoint's actor_train state is loaded and synced to the rollout role
as a resume does, and the evaluation phase runs once. The checkpoint must be one this workflow
could resume (the ``evaluation`` section may differ); greedy decoding then reproduces the
run's own evaluation of that step exactly.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import attrs

from posttrain.checkpoint import manager
from posttrain.checkpoint.record import plain
from posttrain.checkpoint.resume import verified
from posttrain.errors import UserError
from posttrain.loading.hub_models import check_reachable
from posttrain.paths import display_path

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.config.sections import Workflow
    from posttrain.host.plugin_host import PluginHost

REPORT_VERSION = 1


def resolve_checkpoint(workflow: Workflow, checkpoint: str) -> str:
    """``latest`` (the newest complete checkpoint of the workflow's run directory) or a
    checkpoint directory."""
    run_dir = os.path.normpath(os.path.join(workflow.base_dir, workflow.trainer.output_dir))
    if checkpoint == "latest":
        path = manager.latest_checkpoint(run_dir)
        if path is None:
            raise UserError(
                f"--checkpoint latest: {display_path(run_dir)} (trainer.output_dir) holds no "
                "complete checkpoint; give a checkpoint directory, or the run's --set "
                "trainer.output_dir=..."
            )
        return path
    path = os.path.abspath(checkpoint)
    if not os.path.isdir(path):
        raise UserError(
            f"--checkpoint {checkpoint}: no such directory; give RUN_DIR/checkpoint-N or 'latest'"
        )
    return path


def evaluate_checkpoint(
    workflow: Workflow,
    host: PluginHost,
    checkpoint: str,
    out: str | None,
    console: Console,
    source: str = "",
) -> str:
    """Score ``checkpoint`` (a path or ``latest``), write the report (``out``, default
    ``RUN_DIR/eval/checkpoint-N.json``) and return its path."""
    from posttrain.trainer.run import Trainer

    if not workflow.evaluation.datasets:
        raise UserError(
            "the workflow has no evaluation.datasets: nothing to score; add one, e.g. "
            "evaluation: {datasets: [{name: heldout, path: heldout.jsonl}]}"
        )
    if "actor_train" not in workflow.roles():
        raise UserError("the workflow has no actor_train role, whose checkpoint would be scored")
    check_reachable(workflow)
    path = resolve_checkpoint(workflow, checkpoint)
    resumable = verified(path, workflow)
    if "actor_train" not in resumable.manifest.roles:
        raise UserError(f"{display_path(path)} holds no actor_train state")
    eval_dir = os.path.join(os.path.dirname(path), "eval")
    os.makedirs(eval_dir, exist_ok=True)
    out = os.path.abspath(out or os.path.join(eval_dir, os.path.basename(path) + ".json"))
    if os.path.isdir(out):
        raise UserError(f"--out {display_path(out)} is a directory; give a file name")
    # The roles' processes write their logs beside the report, not over the run's.
    trainer_cfg = attrs.evolve(workflow.trainer, output_dir=eval_dir)
    trainer = Trainer(attrs.evolve(workflow, trainer=trainer_cfg), host, console, source)
    datasets = ", ".join(d.name for d in workflow.evaluation.datasets)
    console.print(
        f"evaluating checkpoint {display_path(path)} (step {resumable.manifest.step}) on {datasets}"
    )
    metrics = trainer.score_checkpoint(resumable)
    report = {
        "version": REPORT_VERSION,
        "checkpoint": path,
        "step": resumable.manifest.step,
        "metrics": metrics,
        "evaluation": plain(workflow.evaluation),
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    console.print(f"report: {display_path(out)}")
    for line in summary(metrics):
        console.print(line, markup=False, highlight=False)
    return out


def summary(metrics: dict[str, float]) -> list[str]:
    """The report's metrics, one line per dataset: ``  heldout: reward_mean 0.727, pass@1 ...``
    (``val/<dataset>/<metric>``; counts as integers)."""
    by_set: dict[str, list[str]] = {}
    for key, value in metrics.items():
        name, metric = key.removeprefix("val/").rsplit("/", 1)
        shown = f"{value:.0f}" if metric == "prompts" else f"{value:.3f}"
        by_set.setdefault(name, []).append(f"{metric} {shown}")
    return [f"  {name}: {', '.join(parts)}" for name, parts in by_set.items()]
