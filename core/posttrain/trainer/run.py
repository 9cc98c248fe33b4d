"""``posttrain run``: the single-controller loop.

A step: rollout (and rewards) -> old-policy and reference log-probs -> values -> advantages ->
update -> weight sync -> metrics -> checkpoint. Each phase is a function of the folder it belongs
to; this module holds the run's life cycle and the step that chains them. Every backend is
reached through worker-group calls, which run the strategies' hooks on the ranks.
"""

from __future__ import annotations

import os
import time

import attrs

from posttrain.algorithms.advantages import with_advantages
from posttrain.algorithms.registry import advantage_estimator
from posttrain.backends.models import load_tokenizer
from posttrain.checkpoint import manager as ckpt
from posttrain.checkpoint import plugin_files
from posttrain.checkpoint.manifest import package_versions
from posttrain.checkpoint.record import RECORD, plain, workflow_record
from posttrain.checkpoint.resume import Resumable, checkpoint_to_resume, rerun_hint, verified
from posttrain.checkpoint.saver import CheckpointSaver
from posttrain.config.sections import Workflow
from posttrain.errors import RunInterrupted, WorkerError
from posttrain.evaluation.phase import Evaluation, load_held_out
from posttrain.launch.base import Launcher, WorkerGroup
from posttrain.launch.hang_watch import HangWatch
from posttrain.launch.placement import TimeSharing
from posttrain.launch.plan import resolve_device, start_groups
from posttrain.launch.stacks import (
    install_stack_dump,
    remove_processes,
    target,
    this_node,
    write_processes,
)
from posttrain.paths import display_path
from posttrain.protocol import build_sequence_batch
from posttrain.rewards.pool import RuleRewards
from posttrain.rewards.scoring import RewardScorer, make_rule_rewards, reward_tokenizer
from posttrain.rollout.batches import AsyncBatches, ProducedBatch, SynchronousBatches
from posttrain.rollout.environments.registry import prompt_tools
from posttrain.rollout.generation import Rollout
from posttrain.rollout.groups import collect_groups
from posttrain.scoring.logprobs import critic_values, old_and_reference_logprobs
from posttrain.tasks.data import PromptSampler, load_prompts
from posttrain.trainer.call_stats import add_call_stats, phase_call_stats, split_by_caller
from posttrain.trainer.logger_registry import make_loggers
from posttrain.trainer.phase_timer import PHASES, PhaseTimer
from posttrain.trainer.plugin_metrics import contributed_metrics
from posttrain.trainer.step_log import StepLog
from posttrain.training.update import update
from posttrain.weight_sync.driver import make_transport, sync_weights

# Roles whose state a checkpoint must hold (rollout and reference are rebuilt from them).
TRAINED_ROLES = ("actor_train", "critic")
# Every step's metrics, the driver's own record: a resumed run reads back the steps before its
# checkpoint from here (checkpoints do not copy the history).
HISTORY = "history.jsonl"


@attrs.define
class DriverState:
    """What a checkpoint holds of the driver: the step and the data position."""

    step: int = 0
    sampler: dict[str, int] = attrs.field(factory=dict)


class Trainer:
    def __init__(self, workflow: Workflow, host, console, source: str = ""):
        self.wf = workflow
        self.host = host
        self.console = console
        out = workflow.trainer.output_dir
        self.run_dir = os.path.normpath(os.path.join(workflow.base_dir, out))
        self.device = resolve_device(workflow)
        self.groups: dict[str, WorkerGroup] = {}
        self.launcher: Launcher | None = None
        self.watch: HangWatch | None = None  # the hang watchdog, made with the rank processes
        self.state = DriverState()
        self.record = workflow_record(workflow, source)
        self.rule_rewards: RuleRewards | None = None
        self.evaluation: Evaluation | None = None  # the held-out evaluation phase
        self.batches: SynchronousBatches | AsyncBatches | None = None
        self._stats_groups: dict[str, WorkerGroup] = {}  # asked for rank figures by the loop
        # The run's checkpoint saver, made at the first save (see posttrain.checkpoint.saver).
        self._saver: CheckpointSaver | None = None
        self.steps_run = 0  # steps this run (a resumed run starts after its checkpoint's)
        self.history: list[dict[str, float]] = []  # every step's metrics, the run's first on
        # The checkpoint to resume from, when it is at trainer.max_steps already.
        self.nothing_to_run: str | None = None
        # Names of the metrics plugins add (posttrain_step_metrics): the console shows them.
        self.contributed_metric_names: set[str] = set()

    # -- the run's life cycle ----------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        path = checkpoint_to_resume(self.wf, self.run_dir)
        # Verified before any process starts: a checkpoint that cannot be used is refused fast.
        checkpoint = verified(path, self.wf) if path else None
        if checkpoint is not None:
            self.state = DriverState(checkpoint.state["step"], checkpoint.state["sampler"])
            if self.state.step >= self.wf.trainer.max_steps:
                self.nothing_to_run = checkpoint.path  # and the run directory stays as it is
                return self.history
        self._prepare_run_dir()
        try:
            self._start(checkpoint)
            self._loop()
            if self._saver is not None:
                self._saver.wait()  # the run ends when its last checkpoint is complete
        except KeyboardInterrupt:
            self._close()  # a save in flight stays incomplete, and is never resumed from
            raise RunInterrupted(self._rerun_hint()) from None
        except WorkerError as exc:  # a rank failed or timed out: the checkpoints stay as they are
            self._close()
            exc.hint = f"the run stopped {self._rerun_hint()}"
            raise
        finally:
            self._close()
        self.host.hook.posttrain_run_finished(run_dir=self.run_dir, history=self.history)
        return self.history

    def _rerun_hint(self) -> str:
        done = self.history[-1]["step"] if self.history else self.state.step
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
        self.tokenizer = load_tokenizer(wf.actor_infer.model_args, wf.base_dir)
        tools = prompt_tools(wf.environment, hook)
        prompts = load_prompts(wf.data, wf.base_dir, self.tokenizer, tools)
        sampler = PromptSampler(size=len(prompts), seed=wf.data.seed, shuffle=wf.data.shuffle)
        held_out = load_held_out(wf, self.tokenizer)
        self.rule_rewards = make_rule_rewards(wf.reward, hook)
        self.estimator = advantage_estimator(wf.algorithm, hook)
        self.watch = self._hang_watch()
        self.launcher, self.groups = start_groups(
            wf, self.host, self.run_dir, self.device, self.console, self.watch
        )
        write_processes(self.run_dir, self.watch.targets())  # for posttrain stacks
        self.sharing = TimeSharing(self.groups, enabled=self.device == "cuda")
        self.transport = make_transport(
            hook,
            self.groups["actor_train"],
            self.groups["actor_infer"],
            wf.trainer.weight_sync_bucket_mb << 20,
        )
        score = RewardScorer(
            wf.reward,
            wf.algorithm.group_size,
            wf.actor_infer.generating_args,
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
        rollout = Rollout(wf, infer, self.sharing, prompts, sampler, score, self.tokenizer, hook)
        if checkpoint:
            self._resume(checkpoint, sampler)
        if not loop:
            return
        self.batches = self._batch_source(rollout, sampler)

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

    def _hang_watch(self) -> HangWatch:
        """The driver's watchdog over every call to the ranks (docs/hangs.md); the driver's
        own stacks can be asked for too."""
        stacks = os.path.join(self.run_dir, "logs", "driver.stacks")
        install_stack_dump(stacks)
        if self.device == "cuda":  # where NCCL's flight recorder is dumped (rank_env)
            os.makedirs(os.path.join(self.run_dir, "hangs"), exist_ok=True)
        c = self.wf.cluster
        return HangWatch(
            self.run_dir,
            c.hang_report_s,
            c.call_timeout_s,
            show=lambda text: self.console.print(text, markup=False, highlight=False),
            device=self.device,
            own=(target("driver", os.getpid(), this_node(), stacks),),
        )

    def _resume(self, checkpoint: Resumable, sampler: PromptSampler) -> None:
        for role in checkpoint.manifest.roles:
            self.groups[role].call("load_checkpoint", os.path.join(checkpoint.path, role))
        sampler.load_state(self.state.sampler)
        self.host.hook.posttrain_restore_checkpoint_files(
            step=self.state.step,
            files=plugin_files.read(checkpoint.path, checkpoint.manifest.files),
        )
        self._sync_weights()
        self.console.print(
            f"resumed from {display_path(checkpoint.path)} at step {self.state.step}"
        )

    def _batch_source(
        self, rollout: Rollout, sampler: PromptSampler
    ) -> SynchronousBatches | AsyncBatches:
        """Batches made when a step asks (``max_staleness: 0``) or by a producer thread that
        runs ahead of training (see :mod:`posttrain.rollout.batches`)."""
        algo = self.wf.algorithm

        def produce(index: int, timer: PhaseTimer):
            scored, sampling = collect_groups(
                lambda round_: rollout(index, round_, timer),
                algo.rollout_batch_size,
                algo.group_size,
                algo.dynamic_sampling,
                algo.max_sampling_rounds,
            )
            return scored, sampling, sampler.state()

        version = self.state.step  # the policy the rollout engine holds now
        if not algo.max_staleness:
            self._stats_groups = self.groups
            return SynchronousBatches(produce, version)
        # The producer's thread alone calls the rollout (and reward) processes: it also asks
        # them for their figures, the loop's thread asks the others.
        self._stats_groups, producers = split_by_caller(self.groups)
        return AsyncBatches(
            produce,
            version,
            algo.max_staleness,
            first=self.state.step + 1,
            last=self.wf.trainer.max_steps,
            make_timer=lambda: PhaseTimer(self.console, 0, 0, show=False),
            rank_stats=lambda: phase_call_stats(producers),
        )

    def _close(self) -> None:
        """Stop everything the run started, once: the producer, the reward pool, the saver (a
        save still in flight is left incomplete), the rank processes."""
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        if self.rule_rewards is not None:
            self.rule_rewards.close()
            self.rule_rewards = None
        if self.evaluation is not None:
            self.evaluation.close()
            self.evaluation = None
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        if self.launcher is not None:
            remove_processes(self.run_dir)
            self.launcher.shutdown()
            self.launcher = None

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        t = self.wf.trainer
        saves = [step for step in range(1, t.max_steps + 1) if self._saves_at(step)]
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
            if self.evaluation.before_training(self.state.step) and not self.history:
                self._log({"step": 0, **self._evaluate(timer), **timer.pop()})
            while self.state.step < t.max_steps:
                self.state.step += 1
                self.watch.step = self.state.step
                timer.at_step(self.state.step)
                step_start = time.perf_counter()
                calls_before = self.launcher.driver_calls()
                batch = self.batches.next(self.state.step, timer)
                # The data position of the batch trained on: what a checkpoint must resume.
                self.state.sampler = batch.sampler_state
                metrics = self._step(batch, timer)
                if self.evaluation.due(self.state.step):
                    metrics.update(self._evaluate(timer))
                tokens = metrics.pop("_tokens")
                self._time_step(metrics, timer, step_start, calls_before, tokens)
                metrics.update(self.batches.idle(metrics))
                added = contributed_metrics(self.host, self.state.step, metrics)
                self.contributed_metric_names.update(added)
                metrics.update(added)
                # In the history before the save, so that a resume from the checkpoint of a
                # step finds the step's metrics (the save's own time is added after it, to the
                # live copy).
                self._history_log.append(metrics)
                self.steps_run += 1
                if self._saves_at(self.state.step):
                    with timer.phase("checkpoint"):
                        self._checkpoint()
                    self._time_step(metrics, timer, step_start, calls_before, tokens)
                self.host.hook.posttrain_log_metrics(
                    step=self.state.step, metrics=metrics, run_dir=self.run_dir
                )
        finally:
            timer.stop()

    def _evaluate(self, timer: PhaseTimer) -> dict[str, float]:
        """The held-out evaluation of the trainer's policy: after the step's weight sync the
        rollout engine holds it (asynchronous rollout: the producer waits meanwhile)."""
        with timer.phase("evaluate"), self.batches.engine():
            return self.evaluation.run(self.state.step)

    def _log(self, metrics: dict[str, float]) -> None:
        """A record outside the steps (the evaluation before training, as step 0)."""
        self._history_log.append(metrics)
        self.host.hook.posttrain_log_metrics(
            step=metrics["step"], metrics=metrics, run_dir=self.run_dir
        )

    def score_checkpoint(self, checkpoint: Resumable) -> dict[str, float]:
        """``posttrain eval``: the evaluation phase on ``checkpoint``'s policy, loaded and
        synced to the rollout role as a resume does, without training."""
        self.state = DriverState(checkpoint.state["step"], checkpoint.state["sampler"])
        try:
            self._start(checkpoint, loop=False)
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
        sync: dict = {}
        if policy_learns:
            with timer.phase("weight_sync"):
                sync = self.batches.sync_weights(self._sync_weights, version=self.state.step)
        lengths = [len(r) for r in samples.response_ids]
        return {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            "response/length_mean": sum(lengths) / len(lengths),
            "weight_sync/mb": sync.get("bytes", 0) / 2**20,
            "_tokens": float(batch.attention_mask.sum()),
            **scored.reward_metrics,
            **produced.sampling_metrics,
            **produced.timings,
            **produced.rank_stats,
            **self._staleness(produced),
            **kl_metrics,
            **adv_metrics,
            **train_metrics,
        }

    def _sync_weights(self) -> dict:
        self.sharing.activate("actor_train", "actor_infer")
        train, infer = self.groups["actor_train"], self.groups["actor_infer"]
        return sync_weights(self.host.hook, train, infer, self.transport)

    def _staleness(self, produced: ProducedBatch) -> dict[str, float]:
        """How many updates behind the trainer the policy that sampled the batch is."""
        if not self.wf.algorithm.max_staleness:
            return {}
        return {
            "async/staleness": float(self.state.step - 1 - produced.policy_version),
            "async/policy_version": float(produced.policy_version),
        }

    def _time_step(self, metrics, timer: PhaseTimer, start: float, calls_before: int, tokens):
        """The step's timings so far: each phase, the whole step, and the driver's own work
        (what the phases do not account for, and its calls)."""
        metrics.update(timer.pop())
        metrics["time/step"] = time.perf_counter() - start
        phases = sum(v for k, v in metrics.items() if k.removeprefix("time/") in PHASES)
        metrics["time/outside_phases"] = metrics["time/step"] - phases
        metrics["driver/calls"] = float(self.launcher.driver_calls() - calls_before)
        metrics["perf/tokens_per_s"] = tokens / metrics["time/step"]
        metrics["step"] = self.state.step
        add_call_stats(metrics, phase_call_stats(self._stats_groups))

    # -- checkpoints -------------------------------------------------------------------------

    def _saves_at(self, step: int) -> bool:
        t = self.wf.trainer
        return bool(t.save_steps and step % t.save_steps == 0) or (
            t.save_final and step == t.max_steps
        )

    def _checkpoint(self) -> None:
        """Save every trained role; the loop waits only while the ranks copy their state to
        host memory (``trainer.async_save``), the files are written while it goes on."""
        if self._saver is None:
            roles = [role for role in TRAINED_ROLES if role in self.groups]
            self._saver = CheckpointSaver(
                self.run_dir,
                {role: self.groups[role] for role in roles},
                {role: getattr(self.wf, role).strategy_args.strategy_name for role in roles},
                package_versions(self.host.plugins),
                self.wf.trainer.save_total_limit,
                background=self.wf.trainer.async_save,
                saved=lambda path, manifest: self.host.hook.posttrain_checkpoint_saved(
                    checkpoint_dir=path, manifest=manifest
                ),
                record=self.record,
            )
        files = plugin_files.collect(self.host, self.state.step, self.run_dir)
        self._saver.save(self.state.step, attrs.asdict(self.state), files)


def run_workflow(workflow: Workflow, host, source: str = "", console=None) -> list[dict]:
    from rich.console import Console

    console = console or Console()
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
