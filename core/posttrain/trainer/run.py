"""``posttrain run``: the single-controller loop.

A step: rollout (and rewards) -> old-policy and reference log-probs -> values -> advantages ->
update -> weight sync -> metrics -> checkpoint. Each phase is a function of the folder it belongs
to; this module holds the run's life cycle and the step that chains them. Every backend is
reached through worker-group calls, which run the strategies' hooks on the ranks.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import attrs

from posttrain.algorithms.advantages import with_advantages
from posttrain.algorithms.registry import advantage_estimator
from posttrain.backends.models import load_tokenizer
from posttrain.checkpoint import manager as ckpt
from posttrain.checkpoint import plugin_files
from posttrain.checkpoint.record import RECORD, plain, workflow_record
from posttrain.checkpoint.resume import Resumable, rerun_hint, resumable
from posttrain.checkpoint.schedule import RunCheckpoints
from posttrain.config.sections import Workflow
from posttrain.errors import CheckpointError, RunInterrupted, WorkerError
from posttrain.evaluation.phase import Evaluation, load_held_out
from posttrain.launch.base import Launcher, WorkerGroup
from posttrain.launch.fatal import driver_fatal_report
from posttrain.launch.hang_watch import HangWatch
from posttrain.launch.placement import TimeSharing
from posttrain.launch.plan import resolve_device, start_groups
from posttrain.launch.stacks import (
    remove_processes,
    write_processes,
)
from posttrain.memory.command import checked_for_memory
from posttrain.paths import display_path
from posttrain.protocol import build_sequence_batch
from posttrain.rewards.pool import RuleRewards
from posttrain.rewards.scoring import RewardScorer, make_rule_rewards, reward_tokenizer
from posttrain.rollout.ahead import batch_from_record, batch_record
from posttrain.rollout.batches import AsyncBatches, ProducedBatch, SynchronousBatches
from posttrain.rollout.environments.registry import prompt_tools
from posttrain.rollout.generation import Rollout
from posttrain.rollout.partial import version_metrics
from posttrain.scoring.logprobs import critic_values, old_and_reference_logprobs
from posttrain.tasks.data import PromptSampler, load_prompts
from posttrain.trainer.batch_source import batch_source
from posttrain.trainer.logger_registry import make_loggers
from posttrain.trainer.memory_watch import MemoryWatch
from posttrain.trainer.phase_timer import PhaseTimer
from posttrain.trainer.plugin_metrics import contributed_metrics
from posttrain.trainer.step_log import StepLog
from posttrain.trainer.step_metrics import add_timings, staleness
from posttrain.training.update import update
from posttrain.weight_sync.driver import make_transport, sync_weights

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.host.plugin_host import PluginHost

# Every step's metrics, the driver's own record: a resumed run reads back the steps before its
# checkpoint from here (checkpoints do not copy the history).
HISTORY = "history.jsonl"


@attrs.define
class DriverState:
    """What a checkpoint holds of the driver: the step, the data position, and the batches an
    asynchronous run made ahead of the step (their records, posttrain.rollout.ahead)."""

    step: int = 0
    sampler: dict[str, int] = attrs.field(factory=dict)
    ahead: list[dict] = attrs.field(factory=list)

    @classmethod
    def of_checkpoint(cls, state: dict) -> DriverState:
        # (checkpoints written before batches made ahead were kept have no "ahead")
        return cls(state["step"], state["sampler"], state.get("ahead", []))


class Trainer:
    def __init__(
        self, workflow: Workflow, host: PluginHost, console: Console, source: str = ""
    ) -> None:
        self.host = host
        self.console = console
        out = workflow.trainer.output_dir
        self.run_dir = os.path.normpath(os.path.join(workflow.base_dir, out))
        self.device = resolve_device(workflow)
        self.groups: dict[str, WorkerGroup] = {}
        self.launcher: Launcher | None = None
        self.watch: HangWatch | None = None  # the hang watchdog, made with the rank processes
        self.state = DriverState()
        # The workflow as the user wrote it: a resume or an eval elsewhere resolves `auto`
        # settings for its own GPUs, and must still find the same run.
        self.record = workflow_record(workflow, source)
        self.requested = workflow  # ... which a checkpoint's record is compared with
        # Before any process starts: a plan that cannot fit is refused, auto checkpointing
        # resolved (posttrain.memory).
        self.wf = checked_for_memory(workflow, host, self.device, console)
        self.rule_rewards: RuleRewards | None = None
        self.evaluation: Evaluation | None = None  # the held-out evaluation phase
        self.batches: SynchronousBatches | AsyncBatches | None = None
        self.rollout: Rollout | None = None
        self._stats_groups: dict[str, WorkerGroup] = {}  # asked for rank figures by the loop
        self.checkpoints: RunCheckpoints | None = None  # made with the rank processes
        self.steps_run = 0  # steps this run (a resumed run starts after its checkpoint's)
        self.history: list[dict[str, float]] = []  # every step's metrics, the run's first on
        # The checkpoint to resume from, when it is at trainer.max_steps already.
        self.nothing_to_run: str | None = None
        self.memory_watch = MemoryWatch(
            lambda text: console.print(text, markup=False, highlight=False)
        )
        # Names of the metrics plugins add (posttrain_step_metrics): the console shows them.
        self.contributed_metric_names: set[str] = set()

    # -- the run's life cycle ----------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        # Verified before any process starts: a checkpoint that cannot be used is refused fast.
        checkpoint = resumable(self.wf, self.run_dir, self.requested, self.console.print)
        if checkpoint is not None:
            self.state = DriverState.of_checkpoint(checkpoint.state)
            if self.state.step >= self.wf.trainer.max_steps:
                self.nothing_to_run = checkpoint.path  # and the run directory stays as it is
                return self.history
        self._prepare_run_dir()
        history = os.path.join(self.run_dir, HISTORY)
        # A fatal signal in the driver itself is reported by a watcher (launch/fatal.py).
        with driver_fatal_report(self.run_dir, history, self.wf.trainer.resume):
            try:
                self._start(checkpoint)
                self._loop()
                if self.checkpoints is not None:
                    self.checkpoints.wait()  # the run ends when its last checkpoint is complete
            except KeyboardInterrupt:
                self._close()  # a save in flight stays incomplete, and is never resumed from
                raise RunInterrupted(self._rerun_hint()) from None
            except CheckpointError as exc:  # a save failed (the disk is full): what a rerun does
                self._close()
                exc.args = (f"{exc}\nthe run stopped {self._rerun_hint()}",)
                raise
            except WorkerError as exc:  # a rank failed or timed out: checkpoints stay as they are
                self._close()
                exc.hint = self._knobs(exc) + f"the run stopped {self._rerun_hint()}"
                raise
            finally:
                self._close()
        self.host.hook.posttrain_run_finished(run_dir=self.run_dir, history=self.history)
        return self.history

    def _knobs(self, exc: WorkerError) -> str:
        """For a rank out of GPU memory, the settings that shrink its role (from the plan)."""
        if not exc.user_error or "DeviceOutOfMemory" not in str(exc):
            return ""
        from posttrain.memory.plan import plan_memory

        plan = plan_memory(self.wf, self.host)
        knobs = plan.knobs([r for r in exc.roles if r in plan.roles])
        if not knobs:
            return ""
        return "\n".join(["what would shrink it:", *(f"  {k}" for k in knobs), ""])

    def _rerun_hint(self) -> str:
        done = int(self.history[-1]["step"]) if self.history else self.state.step
        return rerun_hint(self.run_dir, done, self.wf.trainer.resume)

    def _prepare_run_dir(self) -> None:
        """Create the run directory, clear what a crash left half-written, record the workflow
        and open the history (a resumed run keeps its steps up to the checkpoint's)."""
        os.makedirs(self.run_dir, exist_ok=True)
        ckpt.remove_stale_temporaries(self.run_dir)
        # The run directory's record is its latest run's (each checkpoint has its own).
        with open(os.path.join(self.run_dir, RECORD), "wb") as f:
            f.write(self.record)
        self._history_log = StepLog(os.path.join(self.run_dir, HISTORY), self.state.step)
        self.history = self._history_log.records
        missing = self.state.step - len(self.history)
        if missing > 0:
            self.console.print(
                f"note: {display_path(self._history_log.path)} lacks {missing} of the "
                f"{self.state.step} steps before the checkpoint; curves.png will miss them"
            )

    def _start(self, checkpoint: Resumable | None, loop: bool = True) -> None:
        """The loggers, the data, the rank processes, the phases' parts, the resumed state
        (``loop``; without: what ``posttrain eval`` needs, up to the resumed state, and no
        logger)."""
        wf, hook = self.wf, self.host.hook
        if loop:
            # First: a tracker that cannot start (a wrong URI, no login) stops the run before
            # any rank process does.
            self._start_loggers()
        policy = wf.roles()["actor_infer"]
        self.tokenizer = load_tokenizer(policy.model_args, wf.base_dir)
        tools = prompt_tools(wf.environment, hook)
        prompts = load_prompts(wf.data, wf.base_dir, self.tokenizer, tools)
        sampler = PromptSampler(size=len(prompts), seed=wf.data.seed, shuffle=wf.data.shuffle)
        held_out = load_held_out(wf, self.tokenizer)
        self.rule_rewards = make_rule_rewards(wf.reward, hook)
        self.estimator = advantage_estimator(wf.algorithm, hook)
        self.watch = HangWatch.for_driver(
            self.run_dir,
            wf.cluster,
            show=lambda text: self.console.print(text, markup=False, highlight=False),
            device=self.device,
        )
        self.launcher, self.groups = start_groups(
            wf, self.host, self.run_dir, self.device, self.console, self.watch
        )
        write_processes(self.run_dir, self.watch.targets())  # for posttrain stacks
        self.checkpoints = RunCheckpoints(wf, self.host, self.run_dir, self.groups, self.record)
        self.sharing = TimeSharing(self.groups, enabled=self.device == "cuda")
        self.transport = make_transport(
            hook,
            self.groups["actor_train"],
            self.groups["actor_infer"],
            wf.trainer.weight_sync_bucket_mb << 20,
            wf.trainer.weight_sync_verify,
        )
        score = RewardScorer(
            wf.reward,
            wf.algorithm.group_size,
            policy.generating_args,
            self.tokenizer,
            self.rule_rewards,
            self.groups.get("reward"),
            self.sharing,
            reward_tokenizer(wf),
        )
        rules, console = self.rule_rewards, self.console
        self.evaluation = Evaluation(
            wf, held_out, self.groups, self.sharing, self.tokenizer, rules, hook, console
        )
        infer = self.groups["actor_infer"]
        logs = os.path.join(self.run_dir, "logs")
        rollout = Rollout(
            wf, infer, self.sharing, prompts, sampler, score, self.tokenizer, hook, logs
        )
        self.rollout = rollout
        if checkpoint:
            self._resume(checkpoint, sampler)
            if loop:  # posttrain eval loads a checkpoint too, but says so its own way
                self.console.print(
                    f"resumed from {display_path(checkpoint.path)} at step {self.state.step}"
                )
        if not loop:
            return
        ahead = [batch_from_record(record) for record in self.state.ahead]
        self.batches, self._stats_groups = batch_source(
            wf, rollout, sampler, self.groups, self.state.step, self.console, ahead
        )

    def _start_loggers(self) -> None:
        for name, logger in make_loggers(
            self.wf,
            self.host.hook,
            self.console,
            self.run_dir,
            self.state.step,
            self.contributed_metric_names,
            config=plain(self.wf),
        ):
            self.host.pm.register(logger, name=f"logger-{name}")

    def _resume(self, checkpoint: Resumable, sampler: PromptSampler) -> None:
        for role in checkpoint.manifest.roles:
            self.groups[role].call("load_checkpoint", os.path.join(checkpoint.path, role))
        sampler.load_state(self.state.sampler)
        if self.state.ahead:  # the producer goes on after the last batch made ahead
            sampler.load_state(self.state.ahead[-1]["sampler_state"])
        self.host.hook.posttrain_restore_checkpoint_files(
            step=self.state.step,
            files=plugin_files.read(checkpoint.path, checkpoint.manifest.files),
        )
        self._sync_weights()

    def _close(self) -> None:
        """Stop everything the run started, once: the producer, the environments' processes,
        the reward pool, the saver (a save still in flight is left incomplete), the rank
        processes."""
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        if self.rollout is not None:  # after the producer that calls it
            self.rollout.close()
            self.rollout = None
        if self.rule_rewards is not None:
            self.rule_rewards.close()
            self.rule_rewards = None
        if self.evaluation is not None:
            self.evaluation.close()
            self.evaluation = None
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None
        if self.launcher is not None:
            remove_processes(self.run_dir)
            self.launcher.shutdown()
            self.launcher = None

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        checkpoints, evaluation, batches = self.checkpoints, self.evaluation, self.batches
        launcher, watch = self.launcher, self.watch
        # All made by _start, and kept until _close.
        assert checkpoints is not None and evaluation is not None and batches is not None
        assert launcher is not None and watch is not None
        t = self.wf.trainer
        saves = [step for step in range(1, t.max_steps + 1) if checkpoints.due(step)]
        saved = sum(step <= self.state.step for step in saves)
        timer = PhaseTimer(
            self.console,
            t.max_steps,
            self.state.step,
            t.progress,
            counted={"checkpoint": (saved, len(saves))},
        )
        try:
            # (not again when a killed run's step 0 is in the history already)
            if evaluation.before_training(self.state.step) and not self.history:
                self._log({"step": 0, **self._evaluate(timer), **timer.pop()})
            while self.state.step < t.max_steps:
                self.state.step += 1
                watch.step = self.state.step
                timer.at_step(self.state.step)
                step_start = time.perf_counter()
                calls_before = launcher.driver_calls()
                batch = batches.next(self.state.step, timer)
                # The data position of the batch trained on: what a checkpoint must resume.
                self.state.sampler = batch.sampler_state
                metrics = self._step(batch, timer)
                if evaluation.due(self.state.step):
                    metrics.update(self._evaluate(timer))
                tokens = metrics.pop("_tokens")
                self._time_step(metrics, timer, step_start, calls_before, tokens)
                metrics.update(batches.idle(metrics))
                self.memory_watch.check(self.state.step, metrics)
                added = contributed_metrics(self.host, self.state.step, metrics)
                self.contributed_metric_names.update(added)
                metrics.update(added)
                # In the history before the save, so that a resume from the checkpoint of a
                # step finds the step's metrics (the save's own time is added after it, to the
                # live copy).
                self._history_log.append(metrics)
                self.steps_run += 1
                try:
                    if checkpoints.due(self.state.step):
                        with timer.phase("checkpoint"):
                            # What the producer made ahead is kept: the resumed run trains
                            # on the same batches (posttrain.rollout.batches).
                            self.state.ahead = [batch_record(b) for b in batches.ahead()]
                            checkpoints.save(self.state.step, attrs.asdict(self.state))
                        self._time_step(metrics, timer, step_start, calls_before, tokens)
                finally:
                    # Also when Ctrl-C stops the save: the step ran, and the loggers say so.
                    self.host.hook.posttrain_log_metrics(
                        step=self.state.step, metrics=metrics, run_dir=self.run_dir
                    )
        finally:
            timer.stop()

    def _evaluate(self, timer: PhaseTimer) -> dict[str, float]:
        """The held-out evaluation of the trainer's policy: after the step's weight sync the
        rollout engine holds it (asynchronous rollout: the producer waits meanwhile)."""
        batches, evaluation = self.batches, self.evaluation
        assert batches is not None and evaluation is not None  # made by _start
        with timer.phase("evaluate"), batches.engine():
            return evaluation.run(self.state.step)

    def _log(self, metrics: dict[str, float]) -> None:
        """A record outside the steps (the evaluation before training, as step 0)."""
        self._history_log.append(metrics)
        self.host.hook.posttrain_log_metrics(
            step=metrics["step"], metrics=metrics, run_dir=self.run_dir
        )

    def score_checkpoint(self, checkpoint: Resumable) -> dict[str, float]:
        """``posttrain eval``: the evaluation phase on ``checkpoint``'s policy, loaded and
        synced to the rollout role as a resume does, without training."""
        self.state = DriverState.of_checkpoint(checkpoint.state)
        try:
            self._start(checkpoint, loop=False)
            assert self.evaluation is not None  # made by _start
            return self.evaluation.run(self.state.step)
        finally:
            self._close()

    def _step(self, produced: ProducedBatch, timer: PhaseTimer) -> dict[str, float]:
        algo, groups = self.wf.algorithm, self.groups
        scored = produced.scored
        samples, rewards = scored.samples, scored.rewards
        batch = build_sequence_batch(
            samples.prompt_ids,
            samples.response_ids,
            self.tokenizer.pad_token_id,
            samples.response_logprobs,
            loss_mask=samples.loss_mask,
            turn_rewards=scored.turn_rewards,
            policy_versions=samples.policy_versions,
            routing=samples.routing,
            images=samples.images,
        )
        with timer.phase("logprobs"):
            batch, kl_metrics = old_and_reference_logprobs(batch, algo, groups, self.sharing)
        if "critic" in groups:
            with timer.phase("values"):
                batch = critic_values(batch, groups["critic"], self.sharing)
        batch, adv_metrics = with_advantages(batch, rewards, self.estimator, algo)
        # During the critic's warm-up the policy (and so the rollout's weights) stays as is.
        policy_learns = self.state.step > algo.critic_warmup
        train_metrics: dict[str, float] = {}
        with timer.phase("train"):
            if "critic" in groups:
                self.sharing.activate("critic")
                train_metrics.update(update(groups["critic"], batch, algo, False))
            if policy_learns:
                self.sharing.activate("actor_train")
                on_policy = algo.old_logprobs_source() == "rollout"
                train_metrics.update(update(groups["actor_train"], batch, algo, on_policy))
        with timer.phase("weight_sync"):
            # Also without an update: the asynchronous schedule counts every step's sync.
            weights = self._sync_weights if policy_learns else None
            assert self.batches is not None  # made by _start
            sync = self.batches.sync_weights(weights, version=self.state.step)
        lengths = [len(r) for r in samples.response_ids]
        return {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            "response/length_mean": sum(lengths) / len(lengths),
            "weight_sync/mb": sync.get("bytes", 0) / 2**20,
            "weight_sync/verified_buckets": float(sync.get("verified", 0)),
            "_tokens": float(batch.attention_mask.sum()),
            **scored.reward_metrics,
            **produced.sampling_metrics,
            **produced.timings,
            **produced.rank_stats,
            **staleness(self.state.step, produced, algo.max_staleness),
            **version_metrics(samples, self.state.step),
            **kl_metrics,
            **adv_metrics,
            **train_metrics,
        }

    def _sync_weights(self) -> dict[str, float]:
        self.sharing.activate("actor_train", "actor_infer")
        train, infer = self.groups["actor_train"], self.groups["actor_infer"]
        return sync_weights(self.host.hook, train, infer, self.transport)

    def _time_step(
        self,
        metrics: dict[str, float],
        timer: PhaseTimer,
        start: float,
        calls_before: int,
        tokens: float,
    ) -> None:
        assert self.launcher is not None  # made by _start
        calls = float(self.launcher.driver_calls() - calls_before)
        add_timings(metrics, timer, start, calls, tokens, self._stats_groups)
        metrics["step"] = self.state.step
