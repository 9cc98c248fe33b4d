"""A run's checkpoints on the driver: which steps save (``trainer.save_steps``,
``trainer.save_final``) and the saver that writes them, made at the first save."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.checkpoint import plugin_files
from posttrain.checkpoint.manifest import package_versions
from posttrain.checkpoint.saver import CheckpointSaver

if TYPE_CHECKING:
    from posttrain.config.sections import Workflow
    from posttrain.host.plugin_host import PluginHost
    from posttrain.launch.base import WorkerGroup

# Roles whose state a checkpoint must hold (rollout and reference are rebuilt from them).
TRAINED_ROLES = ("actor_train", "critic")


class RunCheckpoints:
    def __init__(
        self,
        wf: Workflow,
        host: PluginHost,
        run_dir: str,
        groups: dict[str, WorkerGroup],
        record: bytes,
    ):
        self.wf, self.host, self.run_dir = wf, host, run_dir
        self.groups = {role: groups[role] for role in TRAINED_ROLES if role in groups}
        self.record = record
        self._saver: CheckpointSaver | None = None

    def due(self, step: int) -> bool:
        t = self.wf.trainer
        return bool(t.save_steps and step % t.save_steps == 0) or (
            t.save_final and step == t.max_steps
        )

    def save(self, step: int, driver_state: dict[str, Any]) -> None:
        """Save every trained role; the caller waits only while the ranks copy their state to
        host memory (``trainer.async_save``), the files are written while it goes on."""
        if self._saver is None:
            self._saver = self._make_saver()
        files = plugin_files.collect(self.host, step, self.run_dir)
        self._saver.save(step, driver_state, files)

    def _make_saver(self) -> CheckpointSaver:
        return CheckpointSaver(
            self.run_dir,
            self.groups,
            {role: getattr(self.wf, role).strategy_args.strategy_name for role in self.groups},
            package_versions(self.host.plugins),
            self.wf.trainer.save_total_limit,
            background=self.wf.trainer.async_save,
            saved=lambda path, manifest: self.host.hook.posttrain_checkpoint_saved(
                checkpoint_dir=path, manifest=manifest
            ),
            record=self.record,
        )

    def wait(self) -> None:
        """Until the last save is complete (the run ends then)."""
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        """Stop the saver; a save still in flight is left incomplete, never resumed from."""
        if self._saver is not None:
            self._saver.close()
            self._saver = None
