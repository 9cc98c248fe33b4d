"""``posttrain run``: the single-controller loop.

rollout -> rewards -> old-policy and reference log-probs -> advantages -> policy update ->
weight sync -> metrics -> checkpoint. Every backend is reached through worker-group calls, which
run the strategies' hooks on the ranks.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import time
from typing import Any

import attrs

from posttrain.algorithms.registry import advantage_estimator
from posttrain.checkpoint import manager as ckpt
from posttrain.checkpoint import plugin_files
from posttrain.checkpoint.manifest import Manifest
from posttrain.checkpoint.record import checkpoint_record, run_changes, workflow_record
from posttrain.checkpoint.saver import CheckpointSaver
from posttrain.config.sections import ROLE_HEADS, RoleConfig, Workflow
from posttrain.data import PromptSampler, load_prompts
from posttrain.environments.registry import environment_specs
from posttrain.environments.runner import EpisodeRunner
from posttrain.errors import CheckpointError, RunInterrupted, UserError
from posttrain.launcher.base import GroupSpec, Launcher, WorkerGroup
from posttrain.paths import display_path
from posttrain.protocol import (
    GenerationRequest,
    RolloutSamples,
    SamplingParams,
    SequenceBatch,
    build_sequence_batch,
    stop_string_start,
)
from posttrain.reward_pool import RuleRewards
from posttrain.rewards import resolve_reward_function, reward_function_names
from posttrain.step_log import StepLog
from posttrain.trainer.batches import AsyncBatches, ProducedBatch, SynchronousBatches
from posttrain.trainer.phases import PHASES, PhaseTimer
from posttrain.trainer.placement import TimeSharing, colocated
from posttrain.trainer.plugin_metrics import contributed_metrics
from posttrain.trainer.sampling import ScoredGroups, collect_groups

# Roles whose state a checkpoint must hold (rollout and reference are rebuilt from them).
TRAINED_ROLES = ("actor_train", "critic")
# The run directory's record of the workflow its latest run ran (each checkpoint has its own).
WORKFLOW_COPY = "workflow.yaml"
# Every step's metrics, the driver's own record: a resumed run reads back the steps before its
# checkpoint from here (checkpoints do not copy the history).
HISTORY = "history.jsonl"


def resolve_device(workflow: Workflow) -> str:
    if workflow.cluster.device != "auto":
        return workflow.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_launcher(workflow: Workflow, plan: list[tuple[str, ...]]) -> Launcher:
    """The workflow's launcher; ``plan`` lists the roles each set of rank processes hosts."""
    cluster = workflow.cluster
    if cluster.launcher == "local":
        from posttrain.launcher.local import LocalLauncher

        return LocalLauncher(
            call_timeout_s=cluster.call_timeout_s, start_timeout_s=cluster.start_timeout_s
        )
    if cluster.launcher == "ray":
        from posttrain.launcher.ray_launcher import RayLauncher

        return RayLauncher(cluster, workflow.roles(), resolve_device(workflow), plan)
    raise UserError(f"cluster.launcher: '{cluster.launcher}' is not available; use local or ray")


def plan_processes(workflow: Workflow, host) -> list[tuple[str, ...]]:
    """Which roles share rank processes (``posttrain_plan_processes``), checked to cover every
    role once with equal device mappings inside a set."""
    roles = workflow.roles()
    plan = [
        tuple(m)
        for m in host.hook.posttrain_plan_processes(workflow=workflow, strategies=host.strategies())
    ]
    listed = [name for members in plan for name in members]
    if sorted(listed) != sorted(roles):
        raise UserError(f"the process plan {plan} must name every role once ({', '.join(roles)})")
    for members in plan:
        mappings = {(roles[m].device_mapping, roles[m].num_ranks) for m in members}
        if len(mappings) > 1:
            raise UserError(
                f"the process plan puts {', '.join(members)} in the same processes, but their "
                "device mappings differ"
            )
    return plan


def group_spec(
    workflow: Workflow,
    role_name: str,
    role: RoleConfig,
    run_dir: str,
    device: str,
    processes: int | None = None,
) -> GroupSpec:
    """``processes``: how many rank processes the whole run starts (default: one per rank of
    every role), among which CPU threads are shared."""
    threads = workflow.cluster.threads_per_worker
    if threads is None and device == "cpu":
        # Share the machine's cores between every rank instead of oversubscribing them.
        ranks = processes or sum(r.num_ranks for r in workflow.roles().values())
        threads = max(1, (os.cpu_count() or 1) // ranks)
    return GroupSpec(
        role=role_name,
        config=role,
        algorithm=workflow.algorithm,
        seed=workflow.trainer.seed,
        run_dir=run_dir,
        base_dir=workflow.base_dir,
        device=device,
        plugins=tuple(workflow.plugins),
        threads=threads,
        env={str(k): str(v) for k, v in workflow.cluster.runtime_env.get("env_vars", {}).items()},
        head=ROLE_HEADS.get(role_name, "lm"),
    )


def package_versions(host) -> dict[str, str]:
    versions = {}
    for dist in ("posttrain", "torch", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    for info in host.plugins:
        if info.distribution and info.version:
            versions[info.distribution] = info.version
    return versions


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
        self.state = DriverState()
        self.source = source
        self.rule_rewards: RuleRewards | None = None
        # The run's checkpoint saver, made at the first save (see posttrain.checkpoint.saver).
        self._saver: CheckpointSaver | None = None
        self.steps_run = 0  # steps this run (a resumed run starts after its checkpoint's)
        self.history: list[dict[str, float]] = []  # every step's metrics, the run's first on
        self.record = workflow_record(workflow, source)
        # The checkpoint to resume from, when it is at trainer.max_steps already.
        self.nothing_to_run: str | None = None
        self.batches: SynchronousBatches | AsyncBatches | None = None
        # Names of the metrics plugins add (posttrain_step_metrics): the console shows them.
        self.contributed_metric_names: set[str] = set()

    # -- set-up ----------------------------------------------------------------------------

    def _checkpoint_to_resume(self) -> str | None:
        """The checkpoint ``trainer.resume`` names, if any (nothing is written yet)."""
        resume = self.wf.trainer.resume
        if resume == "auto":
            return ckpt.latest_checkpoint(self.run_dir)
        if resume != "never":
            return resume if os.path.isabs(resume) else os.path.join(self.wf.base_dir, resume)
        return None

    def _prepare_run_dir(self) -> None:
        """Create the run directory, clear what a crash left half-written, record the workflow
        and open the history (a resumed run keeps its steps up to the checkpoint's)."""
        os.makedirs(self.run_dir, exist_ok=True)
        ckpt.remove_stale_temporaries(self.run_dir)
        with open(os.path.join(self.run_dir, WORKFLOW_COPY), "wb") as f:
            f.write(self.record)
        self._history_log = StepLog(os.path.join(self.run_dir, HISTORY), self.state.step)
        self.history = self._history_log.records
        missing = self.state.step - len(self.history)
        if missing > 0:
            self.console.print(
                f"note: {display_path(self._history_log.path)} lacks {missing} of the "
                f"{self.state.step} steps before the checkpoint; curves.png will miss them"
            )

    def _register_loggers(self) -> None:
        from posttrain.loggers import ConsoleLogger, JsonlLogger, TensorboardLogger

        for name in self.wf.trainer.logger:
            # A resumed run logs again the steps after its checkpoint: the loggers that keep
            # files drop what an earlier (killed) run logged beyond it.
            if name == "console":
                plugin = ConsoleLogger(
                    self.console, self.wf.trainer.max_steps, self.contributed_metric_names
                )
            elif name == "jsonl":
                plugin = JsonlLogger(self.run_dir, start_step=self.state.step)
            else:
                plugin = TensorboardLogger(self.run_dir, start_step=self.state.step)
            self.host.pm.register(plugin, name=f"logger-{name}")

    def _start_groups(self) -> None:
        roles = self.wf.roles()
        plan = plan_processes(self.wf, self.host)
        self.launcher = make_launcher(self.wf, plan)
        processes = sum(roles[members[0]].num_ranks for members in plan)
        for members in plan:
            t0 = time.perf_counter()
            specs = [
                group_spec(self.wf, name, roles[name], self.run_dir, self.device, processes)
                for name in members
            ]
            self.groups.update(self.launcher.start_processes(specs))
            what = " + ".join(
                f"{name} ({roles[name].strategy_args.strategy_name})" for name in members
            )
            ranks = roles[members[0]].num_ranks
            count = f"{ranks} rank process{'es' if ranks > 1 else ''}"
            shared = ", shared" if len(members) > 1 else ""
            self.console.print(f"started {what}: {count}{shared} ({time.perf_counter() - t0:.1f}s)")

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        from posttrain.models import load_tokenizer

        resume_from = self._checkpoint_to_resume()
        # Verified before any process starts: a checkpoint that cannot be used is refused fast.
        checkpoint = self._verified_checkpoint(resume_from) if resume_from else None
        if checkpoint is not None:
            self.state = DriverState(step=checkpoint[2]["step"], sampler=checkpoint[2]["sampler"])
            if self.state.step >= self.wf.trainer.max_steps:
                self.nothing_to_run = checkpoint[0]  # and the run directory stays as it is
                return self.history
        self._prepare_run_dir()
        infer_role = self.wf.actor_infer
        self.tokenizer = load_tokenizer(infer_role.model_args, self.wf.base_dir)
        self.prompts = load_prompts(self.wf.data, self.wf.base_dir, self.tokenizer)
        self.rule_rewards = make_rule_rewards(self.wf.reward, self.host.hook)
        self.reward_tokenizer = reward_tokenizer(self.wf)
        self.estimator = advantage_estimator(self.wf.algorithm, self.host.hook)
        sampler = PromptSampler(
            size=len(self.prompts), seed=self.wf.data.seed, shuffle=self.wf.data.shuffle
        )
        try:
            self._start_groups()
            self.sharing = TimeSharing(self.groups, enabled=self.device == "cuda")
            self.transport = self._make_transport()
            if checkpoint:
                self._resume(checkpoint, sampler)
            self._register_loggers()
            self.batches = self._batch_source(sampler)
            self._loop()
            if self._saver is not None:
                self._saver.wait()  # the run ends when its last checkpoint is complete
        except KeyboardInterrupt:
            self._closed()  # a save in flight stays incomplete, and is never resumed from
            raise RunInterrupted(self._resume_hint()) from None
        finally:
            self._closed()
        self.host.hook.posttrain_run_finished(run_dir=self.run_dir, history=self.history)
        return self.history

    def _closed(self) -> None:
        """Stop everything the run started, once: the producer, the reward pool, the saver (a
        save still in flight is left incomplete), the rank processes."""
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        if self.rule_rewards is not None:
            self.rule_rewards.close()
            self.rule_rewards = None
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        if self.launcher is not None:
            self.launcher.shutdown()
            self.launcher = None

    def _resume_hint(self) -> str:
        """What a rerun of an interrupted run does: from which checkpoint, redoing which steps."""
        done = self.history[-1]["step"] if self.history else self.state.step
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is None:
            return f"after step {done}, with no checkpoint yet: a rerun starts over at step 1"
        saved = Manifest.read(latest).step
        rerun = (
            "rerun the same command"
            if self.wf.trainer.resume == "auto"
            else "rerun with --set trainer.resume=auto"
        )
        redo = ""
        if done > saved:
            redo = (
                f", redoing step {done}"
                if done == saved + 1
                else f", redoing steps {saved + 1}-{done}"
            )
        return (
            f"after step {done}; the last complete checkpoint is {display_path(latest)}: "
            f"{rerun} to continue from step {saved}{redo}"
        )

    def _make_transport(self):
        train, infer = self.groups["actor_train"], self.groups["actor_infer"]
        name = self.host.hook.posttrain_select_weight_transport(
            source=train, target=infer, colocated=colocated(train, infer)
        )
        transports: dict[str, type] = {}
        for mapping in self.host.hook.posttrain_add_weight_transports():
            transports.update(mapping or {})
        if name not in transports:
            raise UserError(
                f"weight transport '{name}' is not provided by any plugin "
                f"(available: {', '.join(sorted(transports))})"
            )
        return transports[name](bucket_bytes=self.wf.trainer.weight_sync_bucket_mb << 20)

    def _verified_checkpoint(self, path: str) -> tuple[str, Manifest, dict[str, Any]]:
        """The checkpoint to resume from, its files checked against its manifest and its
        workflow against this one."""
        manifest, state = ckpt.load_driver_state(path)
        for role in manifest.roles:
            if role not in self.wf.roles():
                raise UserError(
                    f"checkpoint {display_path(path)} holds role '{role}' that this workflow lacks"
                )
        record = checkpoint_record(path)
        changes = run_changes(record["workflow"], self.wf) if record else []
        if changes and not self.wf.trainer.allow_resume_changes:
            shown = "\n".join(f"  {c}" for c in changes[:12])
            if len(changes) > 12:
                shown += f"\n  ... and {len(changes) - 12} more"
            raise CheckpointError(
                f"{display_path(path)} was saved by a different run; resuming it would change "
                f"what that run is:\n{shown}\n"
                "write this run elsewhere (--set trainer.output_dir=runs/NEW), or resume with "
                "these changes (--set trainer.allow_resume_changes=true)"
            )
        return path, manifest, state

    def _resume(self, checkpoint: tuple[str, Manifest, dict[str, Any]], sampler) -> None:
        path, manifest, _ = checkpoint
        for role in manifest.roles:
            self.groups[role].call("load_checkpoint", os.path.join(path, role))
        sampler.load_state(self.state.sampler)
        self.host.hook.posttrain_restore_checkpoint_files(
            step=self.state.step, files=plugin_files.read(path, manifest.files)
        )
        self._sync_weights()
        self.console.print(f"resumed from {display_path(path)} at step {self.state.step}")

    def _batch_source(self, sampler: PromptSampler) -> SynchronousBatches | AsyncBatches:
        """Batches made when a step asks (``max_staleness: 0``) or by a producer thread that
        runs ahead of training (see :mod:`posttrain.trainer.batches`)."""

        def produce(index: int, timer: PhaseTimer):
            scored, sampling = collect_groups(
                lambda round_: self._roll_out_and_score(sampler, index, round_, timer),
                self.wf.algorithm.rollout_batch_size,
                self.wf.algorithm.group_size,
                self.wf.algorithm.dynamic_sampling,
                self.wf.algorithm.max_sampling_rounds,
            )
            return scored, sampling, sampler.state()

        version = self.state.step  # the policy the rollout engine holds now
        if not self.wf.algorithm.max_staleness:
            return SynchronousBatches(produce, version)
        return AsyncBatches(
            produce,
            version,
            self.wf.algorithm.max_staleness,
            first=self.state.step + 1,
            last=self.wf.trainer.max_steps,
            make_timer=lambda: PhaseTimer(self.console, 0, 0, show=False),
        )

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
            while self.state.step < t.max_steps:
                self.state.step += 1
                timer.at_step(self.state.step)
                step_start = time.perf_counter()
                calls_before = self.launcher.driver_calls()
                batch = self.batches.next(self.state.step, timer)
                # The data position of the batch trained on: what a checkpoint must resume.
                self.state.sampler = batch.sampler_state
                metrics = self._step(batch, timer)
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

    def _saves_at(self, step: int) -> bool:
        t = self.wf.trainer
        return bool(t.save_steps and step % t.save_steps == 0) or (
            t.save_final and step == t.max_steps
        )

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

    def _step(self, produced: ProducedBatch, timer: PhaseTimer) -> dict[str, float]:
        algo = self.wf.algorithm
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
            batch, kl_metrics = self._logprobs(batch)
        if "critic" in self.groups:
            with timer.phase("values"):
                batch = self._values(batch)
        batch, adv_metrics = self._advantages(batch, rewards)
        # During the critic's warm-up the policy (and so the rollout's weights) stays as is.
        policy_learns = self.state.step > algo.critic_warmup
        train_metrics: dict[str, float] = {}
        with timer.phase("train"):
            if "critic" in self.groups:
                train_metrics.update(self._train("critic", batch))
            if policy_learns:
                train_metrics.update(self._train("actor_train", batch))
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
            **self._staleness(produced),
            **kl_metrics,
            **adv_metrics,
            **train_metrics,
        }

    def _staleness(self, produced: ProducedBatch) -> dict[str, float]:
        """How many updates behind the trainer the policy that sampled the batch is."""
        if not self.wf.algorithm.max_staleness:
            return {}
        return {
            "async/staleness": float(self.state.step - 1 - produced.policy_version),
            "async/policy_version": float(produced.policy_version),
        }

    # -- phases ----------------------------------------------------------------------------

    def _roll_out_and_score(
        self, sampler: PromptSampler, index: int, round_: int, timer: PhaseTimer
    ) -> ScoredGroups:
        """Draw the prompts of step ``index`` (``round_``: its dynamic-sampling round), roll
        them out and score them."""
        picked = [self.prompts[i] for i in sampler.next(self.wf.algorithm.rollout_batch_size)]
        if self.wf.environment.name:
            return self._run_episodes(picked, index, round_, timer)
        with timer.phase("rollout"):
            samples = self._rollout([p.ids for p in picked], index, round_)
        with timer.phase("reward"):
            rewards, metrics = self._rewards(picked, samples)
        return ScoredGroups(
            prompts=picked, samples=samples, rewards=rewards, reward_metrics=metrics
        )

    def _run_episodes(self, picked, index: int, round_: int, timer: PhaseTimer) -> ScoredGroups:
        """Multi-turn episodes in the workflow's environment (``environment.name``): their
        rewards take the place of the rule function's score."""
        with timer.phase("rollout"):
            self.sharing.activate("actor_infer")
            seed = self._rollout_seed(index, round_)
            episodes = self._episode_runner.run(
                picked,
                self.wf.algorithm.group_size,
                # Each turn samples with a seed of its own, as rounds do.
                lambda contexts, sampling, turn: self._generate(
                    contexts, sampling, seed + turn * 7919
                ),
                self._sampling(),
                f"step {index}" + (f" round {round_}" if round_ else ""),
            )
        with timer.phase("reward"):
            rewards, metrics = self._rewards(picked, episodes.samples, episodes.rewards)
        turn_rewards = None
        if self.wf.environment.reward == "turn":
            weight = self.wf.reward.function_weight
            turn_rewards = [[weight * r for r in row] for row in episodes.turn_rewards]
        return ScoredGroups(
            prompts=picked,
            samples=episodes.samples,
            rewards=rewards,
            reward_metrics={**episodes.metrics, **metrics},
            turn_rewards=turn_rewards,
        )

    @functools.cached_property
    def _episode_runner(self) -> EpisodeRunner:
        """The environment's episode runner, made for the first step (reward.function scores
        the answers environments hand over)."""
        env = self.wf.environment
        spec = environment_specs(self.host.hook)[env.name]
        return EpisodeRunner(spec, env, self.tokenizer, self.rule_rewards)

    def _rollout(
        self, prompt_ids: list[tuple[int, ...]], index: int, round_: int
    ) -> RolloutSamples:
        self.sharing.activate("actor_infer")
        sampling = attrs.evolve(self._sampling(), n=self.wf.algorithm.group_size)
        seed = self._rollout_seed(index, round_)
        return self._generate([list(p) for p in prompt_ids], sampling, seed)

    def _sampling(self) -> SamplingParams:
        """The workflow's sampling settings, for one sample per prompt."""
        gen = self.wf.actor_infer.generating_args
        return SamplingParams(
            n=1,
            temperature=gen.temperature if gen else 1.0,
            top_p=gen.top_p if gen else 1.0,
            top_k=gen.top_k if gen else -1,
            max_new_tokens=gen.max_new_tokens if gen else 32,
            stop_token_ids=tuple(gen.stop_token_ids) if gen else (),
            stop=tuple(gen.stop_strings) if gen else (),
        )

    def _rollout_seed(self, index: int, round_: int) -> int:
        """The seed of step ``index``'s rollout (``round_``: its dynamic-sampling round)."""
        return self.wf.trainer.seed * 1_000_003 + index * 1009 + round_ * 131

    def _generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int
    ) -> RolloutSamples:
        infer = self.groups["actor_infer"]
        dp = infer.dp_size
        # Contiguous shares, the first len % dp one prompt longer (ROLL's 64 prompts over 12
        # engines); concatenated in order, sample i still belongs to prompt i // sampling.n.
        per, extra = divmod(len(prompt_ids), dp)
        bounds = [i * per + min(i, extra) for i in range(dp + 1)]
        requests = [
            GenerationRequest(
                prompt_ids=prompt_ids[bounds[i] : bounds[i + 1]], sampling=sampling, seed=seed + i
            )
            for i in range(dp)
        ]
        return RolloutSamples.concat(infer.call_dp("generate", requests))

    def _rewards(self, picked, samples: RolloutSamples, env_rewards: list[float] | None = None):
        """``function_weight`` x the rule-based function (or, with an environment, its
        episodes' rewards ``env_rewards``) + ``model_weight`` x the reward model's score, per
        sample."""
        import torch

        cfg = self.wf.reward
        metrics: dict[str, float] = {}
        total = torch.zeros(len(samples), dtype=torch.float32)
        scores = None
        if env_rewards is not None:
            scores = torch.tensor(env_rewards, dtype=torch.float32)
        elif self.rule_rewards is not None:
            n = self.wf.algorithm.group_size
            items = [
                (text, picked[i // n].answer, picked[i // n].text)
                for i, text in enumerate(self._response_texts(samples))
            ]
            results = self.rule_rewards(items)
            scores = torch.tensor(results.scores, dtype=torch.float32)
            metrics["reward/errors"] = float(results.errors)
            metrics["reward/timeouts"] = float(results.timeouts)
        if scores is not None:
            total += cfg.function_weight * scores
            if "reward" in self.groups:
                metrics["reward/function_mean"] = float(scores.mean())
        if "reward" in self.groups:
            self.sharing.activate("reward")
            scores = self._model_scores(samples)
            total += cfg.model_weight * scores
            metrics["reward/model_mean"] = float(scores.mean())
        return total, metrics

    def _response_texts(self, samples: RolloutSamples) -> list[str]:
        """Each response as the reward function sees it: decoded, cut at its stop token or
        stop string."""
        gen = self.wf.actor_infer.generating_args
        stop = set(gen.stop_token_ids if gen else ()) | {self.tokenizer.eos_token_id}
        stop_strings = tuple(gen.stop_strings) if gen else ()
        texts = []
        for response in samples.response_ids:
            ids = response[:-1] if response and response[-1] in stop else response
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut = stop_string_start(text, stop_strings)
            texts.append(text if cut is None else text[:cut])
        return texts

    def _model_scores(self, samples: RolloutSamples):
        from posttrain.reward_model import reward_model_batch

        group = self.groups["reward"]
        batch = reward_model_batch(samples, self.tokenizer, self.reward_tokenizer)
        shares = group.call_dp("compute_scores", batch.split(group.dp_size))
        import torch

        return torch.cat([s.float().reshape(-1) for s in shares])

    def _split_call(self, role: str, method: str, batch: SequenceBatch) -> list[Any]:
        group = self.groups[role]
        return group.call_dp(method, batch.split(group.dp_size))

    def _logprobs(self, batch: SequenceBatch) -> tuple[SequenceBatch, dict[str, float]]:
        from posttrain.algorithms.correction import tis_weights
        from posttrain.algorithms.kl import kl_penalty
        from posttrain.protocol import concat_tensor_rows

        algo = self.wf.algorithm
        mask = batch.response_mask
        metrics: dict[str, float] = {}
        if algo.old_logprobs_source() == "rollout":
            # On-policy: the policy that sampled is the one being updated, so the rollout's
            # log-probs are the old policy's (the mismatch is measured in the first update).
            old = batch["rollout_logprobs"] * mask
        else:
            self.sharing.activate("actor_train")
            old = concat_tensor_rows(self._split_call("actor_train", "compute_logprobs", batch))
            old = old * mask
            metrics.update(rollout_mismatch(batch["rollout_logprobs"], old, mask))
            if algo.tis_cap is not None:
                weights, tis_metrics = tis_weights(
                    old, batch["rollout_logprobs"], mask.float(), algo.tis_cap
                )
                batch = batch.with_tensors(tis_weights=weights)
                metrics.update(tis_metrics)
        batch = batch.with_tensors(old_logprobs=old)
        if "reference" in self.groups:
            self.sharing.activate("reference")
            ref = concat_tensor_rows(self._split_call("reference", "compute_logprobs", batch))
            batch = batch.with_tensors(ref_logprobs=ref * mask)
            kl = kl_penalty(old, ref, algo.kl_estimator) * mask
            metrics["actor/kl"] = float(kl.sum() / mask.sum().clamp(min=1))
            batch = batch.with_tensors(token_kl=kl)
        return batch, metrics

    def _values(self, batch: SequenceBatch) -> SequenceBatch:
        from posttrain.protocol import concat_tensor_rows

        self.sharing.activate("critic")
        values = concat_tensor_rows(self._split_call("critic", "compute_values", batch))
        return batch.with_tensors(values=values * batch.response_mask)

    def _advantages(self, batch: SequenceBatch, rewards):
        result = self.estimator.estimate(batch, rewards, self.wf.algorithm)
        tensors = {"advantages": result.advantages * batch.response_mask}
        if result.returns is not None:
            tensors["returns"] = result.returns
        metrics = {"adv/abs_mean": _masked_mean(result.advantages.abs(), batch.response_mask)}
        metrics.update(result.metrics)
        return batch.with_tensors(**tensors), metrics

    def _train(self, role: str, batch: SequenceBatch) -> dict[str, float]:
        """``ppo_epochs`` passes over ``num_mini_batches`` mini-batches, one optimizer step
        each, on ``role`` (the actor or the critic)."""
        from posttrain.metrics import accumulate, combine, is_max

        algo = self.wf.algorithm
        group = self.groups[role]
        self.sharing.activate(role)
        measure = role == "actor_train" and algo.old_logprobs_source() == "rollout"
        totals: dict[str, float] = {}
        reported: dict[str, int] = {}
        for _ in range(algo.ppo_epochs):
            for mini in batch.split(algo.num_mini_batches):
                mini.meta.update(
                    global_tokens=float(mini.response_mask.sum()),
                    global_seqs=float(len(mini)),
                    dp_size=group.dp_size,
                    measure_rollout_mismatch=measure,
                )
                measure = False  # only before the first update is the policy the sampler
                answers = group.call_dp("train_step", mini.split(group.dp_size))
                # grad norm and lr are the same on every rank: rank 0's; the rest are shares.
                update = combine(
                    {k: v for k, v in a.items() if a is answers[0] or not _per_step(k)}
                    for a in answers
                )
                for key in update:
                    reported[key] = reported.get(key, 0) + 1
                accumulate(totals, update)
        return {k: v if is_max(k) else v / reported[k] for k, v in totals.items()}

    def _sync_weights(self) -> dict:
        self.sharing.activate("actor_train", "actor_infer")
        result = self.host.hook.posttrain_sync_weights(
            source=self.groups["actor_train"],
            target=self.groups["actor_infer"],
            transport=self.transport,
        )
        return result or {}

    def _checkpoint(self) -> None:
        """Save every trained role; the loop waits only while the ranks copy their state to
        host memory (``trainer.async_save``), the files are written while it goes on."""
        if self._saver is None:
            roles = [role for role in TRAINED_ROLES if role in self.groups]
            self._saver = CheckpointSaver(
                self.run_dir,
                {role: self.groups[role] for role in roles},
                {role: getattr(self.wf, role).strategy_args.strategy_name for role in roles},
                package_versions(self.host),
                self.wf.trainer.save_total_limit,
                background=self.wf.trainer.async_save,
                saved=lambda path, manifest: self.host.hook.posttrain_checkpoint_saved(
                    checkpoint_dir=path, manifest=manifest
                ),
                record=self.record,
            )
        state = attrs.asdict(self.state)
        files = plugin_files.collect(self.host, self.state.step, self.run_dir)
        self._saver.save(self.state.step, state, files)


def _masked_mean(values, mask) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def reward_tokenizer(workflow: Workflow):
    """The reward model's tokenizer when it is not the policy's (then responses are decoded and
    encoded again for it), else None."""
    from posttrain.models import load_tokenizer, resolve_model_path

    reward = workflow.reward
    if reward.role() is None:
        return None

    def tokenizer_path(args) -> str:
        return resolve_model_path(
            args.tokenizer_name_or_path or args.model_name_or_path, workflow.base_dir
        )

    if tokenizer_path(reward.model_args) == tokenizer_path(workflow.actor_infer.model_args):
        return None
    return load_tokenizer(reward.model_args, workflow.base_dir)


def make_rule_rewards(reward, hook) -> RuleRewards | None:
    """The rule-based reward function of ``reward``, or None when the workflow has none."""
    if not reward.function:
        return None
    fn = resolve_reward_function(reward.function, hook)
    target = reward_function_names(hook).get(reward.function, reward.function)
    return RuleRewards(fn, target, reward.kwargs, reward.num_workers, reward.timeout_s)


def _per_step(key: str) -> bool:
    """Metrics every rank reports alike (not shares to add up)."""
    return key.endswith(("grad_norm", "lr"))


def rollout_mismatch(rollout, trainer, mask) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's."""
    diff = (rollout - trainer).abs() * mask
    return {
        "rollout/logprob_diff_mean": float(diff.sum() / mask.sum().clamp(min=1)),
        "rollout/logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
    }


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
