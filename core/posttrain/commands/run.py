"""``posttrain run``: the command around a :class:`~posttrain.trainer.run.Trainer`: where the
run goes, and what it did or why it had nothing to do."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from posttrain.config.sections import Workflow
from posttrain.loading.hub_models import check_reachable
from posttrain.paths import display_path
from posttrain.trainer.run import Trainer

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.host.plugin_host import PluginHost


def run_workflow(
    workflow: Workflow, host: PluginHost, source: str = "", console: Console | None = None
) -> list[dict[str, Any]]:
    from rich.console import Console

    console = console or Console()
    check_reachable(workflow)  # before the run directory is made
    trainer = Trainer(workflow, host, console, source=source)
    console.print(f"run directory: {display_path(trainer.run_dir)}")
    history = trainer.run()
    if trainer.nothing_to_run:
        steps = workflow.trainer.max_steps
        console.print(
            f"nothing to run: {display_path(trainer.nothing_to_run)} is at step "
            f"{trainer.state.step} and trainer.max_steps is {steps}; raise it to train on "
            f"(--set trainer.max_steps={max(steps, trainer.state.step) * 2}); the run directory "
            "is unchanged"
        )
        return history
    first = trainer.state.step - trainer.steps_run + 1
    console.print(
        f"done: {trainer.steps_run} steps this run (steps {first}-{trainer.state.step}); curves at "
        f"{display_path(os.path.join(trainer.run_dir, 'curves.png'))}"
    )
    return history
