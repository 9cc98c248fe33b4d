"""Every hook specification of posttrain, in one module.

Plugins implement these with ``@posttrain.hookimpl``. Two kinds of hooks exist:

* **driver hooks** run in the single controller process (the one that runs ``posttrain``);
* **worker hooks** run on each rank of a role's worker group, in the worker process.

Worker hooks that act on one strategy are ``firstresult``: every implementation first checks
``worker.strategy_name`` and returns ``None`` when the strategy is not its own, so the plugin that
owns the strategy answers. Cross-cutting plugins wrap them with ``wrapper=True`` (or the older
``hookwrapper=True``) to time, log or transform, without owning a strategy. The model for this
module is pytest's ``_pytest/hookspec.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# hookimpl re-exported for plugins that import it from here (posttrain.hookimpl is the face).
from posttrain.markers import hookimpl as hookimpl
from posttrain.markers import hookspec

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterable, Iterator, Mapping

    import pluggy
    import torch

    from posttrain.algorithms.registry import AdvantageEstimator, AlgorithmPreset, PolicyLossTerm
    from posttrain.checkpoint.manifest import Manifest
    from posttrain.config.report import ErrorReport
    from posttrain.config.sections import Workflow
    from posttrain.host.doctor import EnvCheck
    from posttrain.host.strategy import StrategySpec
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.worker import WorkerContext
    from posttrain.memory.estimate import MemoryQuery, RoleMemory
    from posttrain.protocol import GenerationRequest, RolloutSamples, SequenceBatch, WeightBucket
    from posttrain.rollout.environments.protocol import EnvironmentSpec
    from posttrain.trainer.logger_spec import LoggerSpec
    from posttrain.weight_sync.transport import WeightTransport


# --------------------------------------------------------------------------------------------
# Registration (driver and worker processes)
# --------------------------------------------------------------------------------------------


@hookspec
def posttrain_add_strategies() -> list[StrategySpec]:
    """Declare the strategies this plugin provides.

    Called by the plugin host once per process (driver and every worker) right after the plugins
    are loaded. Return a list of :class:`posttrain.StrategySpec`, each with its
    ``strategy_config`` class (an attrs class, ``frozen=True, kw_only=True``) and its capabilities
    (parallel dimensions, dtypes, colocation, weight-sync transports). Must not import engines:
    ``posttrain validate`` calls it. Two plugins declaring one name is an error naming both.
    Not firstresult: the host collects every plugin's list.

    ``Capabilities.kind`` decides which worker hooks the core calls for the strategy and which
    roles it may fill (any other value is a ``PluginError`` naming the plugin):

    - ``"train"``: ``actor_train``, ``critic`` (``"value"`` in ``heads``), ``reference``; the
      core calls ``train_step``, ``compute_logprobs``, ``export_weights``, the checkpoint hooks,
      ``export_hf`` and, for a critic, ``compute_values``.
    - ``"rollout"``: ``actor_infer``, ``reference``, ``reward`` (``"score"`` in ``heads``); the
      core calls ``generate``, ``import_weights`` (weight sync), ``compute_logprobs`` and, for a
      reward model, ``compute_scores``.
    - ``"infer"``: ``reference``, ``reward``; forward passes only (``compute_logprobs``,
      ``compute_scores``) on the weights it loaded: never ``generate`` nor ``import_weights``.

    Every kind gets ``setup_parallel``, ``load_model``, ``release_memory``/``resume_memory``
    (devices shared with another role) and ``shutdown_worker``. An engine that generates is
    therefore ``"rollout"``, not ``"infer"``; the conformance kit fails a strategy whose declared
    capabilities and implemented hooks disagree. :class:`posttrain.Capabilities` has
    the details.
    """


@hookspec
def posttrain_add_reward_functions() -> dict[str, str]:
    """Declare named reward functions: ``{name: "module:function"}``.

    Called on the driver when the workflow's ``reward.function`` is resolved. A name declared here
    can be used in YAML instead of a ``module:function`` path. The function is imported lazily.
    Not firstresult: the host merges all dicts (a name declared twice is an error).
    """


@hookspec
def posttrain_add_weight_transports() -> dict[str, type[WeightTransport]]:
    """Declare weight-sync transports: ``{name: WeightTransport subclass}``.

    Called on the driver before the first weight sync. The core provides ``shared_memory`` and
    ``broadcast``; a plugin may add e.g. a compressed or a disk transport. Not firstresult.
    """


@hookspec
def posttrain_add_advantage_estimators() -> dict[str, AdvantageEstimator]:
    """Declare advantage estimators: ``{name: AdvantageEstimator}``.

    Called on the driver when a workflow is validated and before a run's first step. An
    :class:`posttrain.AdvantageEstimator` turns a step's rewards (and the
    critic's values, when it says it needs them) into per-token advantages and, for a critic,
    returns. ``algorithm.advantage_estimator`` names one; the core's ``trylast`` implementation
    provides ``grpo``, ``rloo``, ``reinforce_plus_plus`` and ``gae``. Not firstresult: the host
    merges every plugin's dict (a name declared twice is an error naming both).
    """


@hookspec
def posttrain_add_policy_losses() -> dict[str, PolicyLossTerm]:
    """Declare policy losses: ``{name: PolicyLossTerm}``.

    Called on the driver when a workflow is validated and on every rank of ``actor_train``
    when it builds the loss of a train step. A
    :class:`posttrain.PolicyLossTerm` maps log-probs, old log-probs and
    advantages to a per-token loss; the core adds the KL and entropy terms, the rollout
    correction weights and the aggregation. ``algorithm.policy_loss`` names one; the core's
    ``trylast`` implementation provides ``ppo`` (clipped, with dual-clip) and ``gspo``
    (sequence-level ratio). Not firstresult: the host merges every plugin's dict.
    """


@hookspec
def posttrain_add_algorithms() -> dict[str, AlgorithmPreset]:
    """Declare algorithm presets: ``{name: AlgorithmPreset}``.

    Called on the driver when a workflow is validated, and on every rank of ``actor_train``
    when it builds the loss of a train step (the preset names the policy loss).
    ``algorithm.name`` picks a preset: the advantage estimator and policy loss it uses unless
    ``algorithm.advantage_estimator`` / ``algorithm.policy_loss`` name others, and whether it
    trains a critic. The core's ``trylast`` implementation provides ``grpo``, ``ppo``,
    ``reinforce_plus_plus``, ``rloo``, and ``gspo``. Not firstresult.
    """


@hookspec
def posttrain_add_cli_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add subcommands to the ``posttrain`` CLI.

    Called on the driver while the argument parser is built. Add a parser with
    ``subparsers.add_parser(...)`` and ``set_defaults(handler=fn)``; the CLI calls
    ``fn(args, host) -> int`` (``host`` is the :class:`posttrain.host.plugin_host.PluginHost`) and
    exits with its return value. Raise :class:`posttrain.UserError` for user mistakes.
    Not firstresult.
    """


# --------------------------------------------------------------------------------------------
# Validation and environment (driver)
# --------------------------------------------------------------------------------------------


@hookspec
def posttrain_validate_workflow(
    workflow: Workflow,
    strategies: dict[str, StrategySpec],
    report: ErrorReport,
    hook: pluggy.HookRelay,
) -> None:
    """Add cross-field checks for a structured workflow.

    ``strategies`` maps every installed strategy name to its spec. Roles whose strategy is
    unknown or whose ``strategy_config`` failed to structure still hold a plain dict there.
    ``hook`` is the plugin host's hook relay, for checks that look a name up in what other
    hooks register (algorithm pieces, reward functions). A section that failed to structure is
    in ``report.failed_sections``: skip its checks. Core's own checks (the algorithm, the
    reward function, evaluation, roles and devices) are ``trylast`` implementations.

    Called on the driver by ``posttrain validate`` and before ``posttrain run`` starts any
    process, after every section was structured. Report problems with
    ``report.error(path, message, hint=...)``; never raise for user errors (all errors are shown
    at once). Strategy plugins check their own roles here (e.g. parallel sizes against
    ``device_mapping``). Must not import engines. Not firstresult.
    """


@hookspec
def posttrain_environment_checks() -> list[EnvCheck]:
    """Return environment checks for ``posttrain doctor``.

    Called on the driver. Each :class:`posttrain.EnvCheck` names a package, the version
    range the plugin was tested with and how to find the installed version. Not firstresult.
    """


@hookspec(firstresult=True)
def posttrain_plan_processes(
    workflow: Workflow, strategies: dict[str, StrategySpec]
) -> list[tuple[str, ...]] | None:
    """Decide which roles share one set of rank processes (the hybrid engine).

    Called on the driver by ``posttrain run`` before any process starts (and by ``posttrain
    validate``, to show the layout). Return a list of role-name tuples covering every role of
    the workflow once; the roles of one tuple are hosted by the same rank processes, each rank
    holding one :class:`~posttrain.WorkerContext` per role, so they must have the same
    ``device_mapping``. The core's trylast implementation groups roles with equal device
    mappings whose strategies all declare ``Capabilities.shares_process`` (unless
    ``cluster.colocation`` is ``separate``). A strategy plugin whose strategies cannot share a
    process in some configurations wraps this hook (``wrapper=True``) and splits the tuples.
    firstresult.
    """


@hookspec(firstresult=True)
def posttrain_estimate_memory(query: MemoryQuery) -> RoleMemory | None:
    """Estimate one GPU's share of a role: what it holds between calls and what each phase it
    works in needs on top.

    Called on the driver by ``posttrain plan``, and by ``posttrain run`` before any process
    starts (to refuse a workflow that cannot fit, and to resolve ``model_args.
    disable_gradient_checkpointing: auto``). ``query`` (:class:`posttrain.MemoryQuery`) holds
    the role (its ``strategy_config`` structured as ``query.config``), the model's geometry and
    the step's workload. Return a :class:`posttrain.RoleMemory` in bytes (the formulas in
    :mod:`posttrain.memory.estimate` are shared: activations, logits, Adam's state), with the
    ``knobs`` that shrink it. Must not import engines. firstresult: return None for strategies
    you do not own; a role nobody estimates is left out of the plan, with a note.
    """


# --------------------------------------------------------------------------------------------
# Worker lifecycle (worker processes; firstresult, answered by the strategy's owner)
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def posttrain_setup_parallel(worker: WorkerContext) -> dict[str, int] | None:
    """Create this rank's process groups / device mesh.

    Called once on every rank of a worker group, before model loading. The launcher has set
    MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK. Return the rank's coordinates, at
    least ``{"dp_rank": ..., "dp_size": ...}``; the driver uses them to split batches.
    firstresult: return None for strategies you do not own.
    """


@hookspec(firstresult=True)
def posttrain_load_model(worker: WorkerContext) -> Any | None:
    """Build or load the model (HF path, preset, mbridge, dist checkpoint) into the layout.

    Called once on every rank, after ``posttrain_setup_parallel``. Return the backend's model
    handle (stored as ``worker.model``). firstresult: return None for strategies you do not own.
    """


@hookspec(firstresult=True)
def posttrain_generate(worker: WorkerContext, request: GenerationRequest) -> RolloutSamples | None:
    """Generate completions with the log-prob of every sampled token.

    Called on every rank of a rollout role with this rank's share of the prompts (token ids).
    Return :class:`posttrain.RolloutSamples` (``n`` samples per prompt, in prompt
    order). firstresult: return None for strategies you do not own.
    """


@hookspec(firstresult=True)
def posttrain_compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor | None:
    """Return log-probs of the given sequences: a float32 tensor shaped like ``batch.input_ids``.

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1``; position 0 is 0.
    Called on every rank of a role (reference, old-policy, critic) with its data-parallel share.
    firstresult: return None for strategies you do not own.
    """


@hookspec(firstresult=True)
def posttrain_compute_values(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor | None:
    """Return a value model's estimates: a float32 tensor shaped like ``batch.input_ids``.

    ``out[b, t] = V(input_ids[b, :t])``: the value head applied to the last hidden state at
    position ``t - 1`` (the state in which token ``t`` was chosen), for ``t >= 1``; position 0
    and positions outside ``attention_mask`` are 0. This aligns values with log-probs, so the
    response mask selects both. Called on every rank of the ``critic`` role (its
    ``worker.head`` is ``"value"``) with its data-parallel share. The value head is a bias-free
    ``Linear(hidden, 1)`` named ``score`` in HF terms (as ``*ForTokenClassification`` with one
    label), zero when the weights do not hold one. firstresult.
    """


@hookspec(firstresult=True)
def posttrain_compute_scores(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor | None:
    """Return a reward model's score of every sequence: a float32 tensor of shape ``[rows]``.

    The score head (HF ``*ForSequenceClassification`` with one label) applied to the last hidden
    state of each row's last attended position. Called on every rank of the ``reward`` role
    (``worker.head`` is ``"score"``) with its data-parallel share. firstresult.
    """


@hookspec(firstresult=True)
def posttrain_train_step(
    worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any]
) -> dict[str, float] | None:
    """Run one optimizer step on this rank's share of the batch; return scalar metrics.

    Called on every rank of ``actor_train`` and ``critic``. ``loss_fn(outputs, entropy,
    micro_batch) -> (loss, metrics)`` is the algorithm's loss from core; the backend splits the
    batch into micro-batches, accumulates gradients, clips and steps. ``outputs`` are per-token
    log-probs (aligned as ``posttrain_compute_logprobs``) for a language-model head, and values
    (aligned as ``posttrain_compute_values``, ``entropy`` None) when ``worker.head`` is
    ``"value"``. Metric names carry the role's prefix (``actor/``, ``critic/``). firstresult.
    """


# --------------------------------------------------------------------------------------------
# Weight sync (export on trainer ranks, import on rollout ranks, orchestration on the driver)
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def posttrain_export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool
) -> Iterator[WeightBucket] | None:
    """Yield the trainer's weights as buckets of HF-named full tensors.

    Called on every rank of the trainer group at the same time (the gather is collective).
    A bucket never splits a fused group (q/k/v, gate/up of one layer). firstresult.

    * ``on_device=False``: the buckets leave the process through host memory (shared memory,
      an HF export). The rank that holds the gathered result (rank 0) yields host (CPU) tensors
      in the export dtype; the other ranks yield empty buckets, in the same number.
    * ``on_device=True``: the buckets stay on the device: the rollout role lives in this same
      process (hybrid engine), or a collective sends them from the device (the ``broadcast``
      transport). *Every* rank yields the full tensors, gathered over the trainer's own process
      groups and left on its device in the export dtype, with no host copy (a tensor may be a
      view of a live parameter); each bucket is consumed before the next one is asked for.
    """


@hookspec(firstresult=True)
def posttrain_import_weights(worker: WorkerContext, buckets: Iterable[WeightBucket]) -> bool | None:
    """Load HF-named tensors into the rollout engine, then flush its caches.

    Called on every rank of the rollout group with every bucket of one sync. ``buckets`` may be
    a generator that exports the next bucket as it is consumed (the ``in_process`` transport
    streams device tensors this way): load each bucket before taking the next, and keep no
    reference to its tensors. Return True when done. firstresult: return None for strategies
    you do not own.
    """


@hookspec(firstresult=True)
def posttrain_weight_shapes(worker: WorkerContext) -> dict[str, tuple[int, ...]] | None:
    """The HF-named tensors the rollout engine takes in a weight sync, with their whole shapes.

    Called on a rank of the rollout group once, at the first bucket of a sync that is verified
    (``trainer.weight_sync_verify``); a bucket's tensor whose name is not among them or whose
    shape differs stops the run naming both (an engine upgrade that renamed a parameter).
    Return None (the default) and names and shapes go unchecked (the byte sums still are).
    firstresult: return None for strategies you do not own.
    """


@hookspec(firstresult=True)
def posttrain_weight_receiver(worker: WorkerContext) -> Any | None:
    """Return an object whose engine receives the ``broadcast`` transport's buckets itself.

    Called on every rank of the rollout group when the broadcast transport sets up its sync
    group. Return None (the default) and the rank joins the group, receives each bucket and
    calls ``posttrain_import_weights``. Return a receiver when the engine's own processes take
    the rank's place in the group (SGLang's ``init_weights_update_group`` /
    ``update_weights_from_distributed``); the rank then calls, each on the driver's request:

    * ``receiver.join(address, port, rank, world_size, group_name, timeout_s)``: join the group
      named ``group_name`` as group rank ``rank`` (an engine spanning several ranks of its role
      may hold ``rank`` and the next ones, which the other ranks' receivers then leave alone);
    * ``receiver.receive(meta, group_name) -> bool``: take part in one bucket's broadcast and
      load it (``meta``: ``(name, shape, dtype, nbytes)`` per tensor), then flush caches;
    * ``receiver.leave(group_name)``: leave the group.

    The group's layout and the bucket's wire format are described in
    :mod:`posttrain.weight_sync.rank_side`. Give up with an error after ``timeout_s`` rather
    than wait for a peer forever. firstresult: return None for strategies you do not own.
    """


@hookspec(firstresult=True)
def posttrain_select_weight_transport(
    source: WorkerGroup, target: WorkerGroup, colocated: bool
) -> str | None:
    """Pick the transport for a trainer -> rollout weight sync.

    Called on the driver once per (source, target) pair. ``source`` and ``target`` are the
    worker groups; ``source.shares_processes_with(target)`` tells whether both roles live in
    the same rank processes. The core's trylast implementation picks ``in_process`` for roles in
    the same processes, ``shared_memory`` for separate processes on the same devices and
    ``broadcast`` otherwise. Return a name declared through ``posttrain_add_weight_transports``.
    """


@hookspec(firstresult=True)
def posttrain_sync_weights(
    source: WorkerGroup, target: WorkerGroup, transport: WeightTransport
) -> dict[str, Any] | None:
    """Move the policy weights from ``source`` (trainer group) to ``target`` (rollout group).

    Called on the driver after each policy update. The core's trylast implementation runs the
    transport and returns ``{"bytes": ..., "buckets": ...}``. Wrap it (hookwrapper) to time,
    compress or verify syncs.
    """


# --------------------------------------------------------------------------------------------
# Checkpointing (worker processes, under the core's checkpoint manager)
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def posttrain_save_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any] | None:
    """Save model, optimizer and scheduler state of this role into directory ``path``.

    Called on every rank (saves are collective). ``path`` is inside the checkpoint's temporary
    directory; the core renames it into place only after every role finished and checksums are
    written. Return layout metadata for the manifest (e.g. ``{"format": "dcp", "dp": 2}``).
    """


@hookspec(firstresult=True)
def posttrain_begin_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any] | None:
    """Start saving this role's state into directory ``path`` without holding up training.

    Called on every rank (saves are collective) by the driver's checkpoint saver, in place of
    ``posttrain_save_checkpoint``, when ``trainer.async_save`` is on. The training loop waits
    only for this call, so: copy the state to host buffers (allocated at the first save and
    reused; a save that would not fit in host memory is refused here, with figures, before
    anything is copied: :class:`posttrain.HostBuffers` does both), start
    writing files under ``path`` in the background, and return the layout metadata for the
    manifest at once (as ``posttrain_save_checkpoint`` does).

    Completion convention: when every file this rank writes under ``path`` is complete and
    fsynced, the rank writes its completion marker (:mod:`posttrain.checkpoint.background`:
    ``BackgroundSave`` does it, with the sha256 of each file computed while writing through
    :class:`posttrain.FileDigests`). The driver renames the checkpoint into
    place only once every rank's marker is there; a marker carrying an error fails the save.
    Files a marker does not list are checksummed by the driver reading them back. Never modify
    a file after the marker is written.

    firstresult. Return None (the default) to save synchronously through
    ``posttrain_save_checkpoint`` instead: ``deepspeed_train`` does, and so does any strategy
    that implements only that hook.
    """


@hookspec(firstresult=True)
def posttrain_finish_checkpoint(worker: WorkerContext, path: str) -> bool | None:
    """Block until the background save begun into ``path`` has written this rank's marker.

    Called on every rank by the driver where a save must be complete: before the next save
    begins (at most one save is in flight) and at the end of the run. Collective work that
    ends a save (megatron's gather of write results and its metadata files) may run here, and
    an engine may also run it earlier at a point all ranks reach together (megatron_train does
    at the start of its next train step). Raise if the background write failed. Return True;
    None (the default) when the strategy has nothing in flight (synchronous saves).
    firstresult.
    """


@hookspec(firstresult=True)
def posttrain_load_checkpoint(worker: WorkerContext, path: str) -> bool | None:
    """Restore what ``posttrain_save_checkpoint`` wrote into ``path``. Called on every rank."""


@hookspec(firstresult=True)
def posttrain_export_hf(worker: WorkerContext, path: str, merge: bool) -> bool | None:
    """Write the model as an HF directory (config, safetensors, tokenizer) into ``path``.

    Called on every rank (gathers are collective); rank 0 writes. Return True when done.
    A role that trains LoRA adapters (``model_args.lora``, strategies with the ``lora``
    capability) writes the adapter in peft's format into ``path``; with ``merge`` (``posttrain
    export-hf --merge``, only passed for such roles) the merged model into ``path`` and the
    adapter into ``path/adapter``.
    """


@hookspec
def posttrain_checkpoint_files(step: int, run_dir: str) -> dict[str, bytes] | None:
    """Contribute files to the checkpoint of ``step``: ``{relative path: content}``.

    Called on the driver, on the loop's thread, each time a save begins (after the step's
    metrics are in the history, before any rank is asked to save). The core writes every file
    under ``plugin_files/`` in the checkpoint's temporary directory, hashes it while writing and
    lists it in the manifest, so resume verifies it like the ranks' files: a corrupted or missing
    file makes resume refuse the checkpoint, naming the file. Return the bytes as they are at
    this step (a background save completes later; the bytes are taken now). Paths are relative,
    use ``/``, and should start with the plugin's name (``"myplugin/state.json"``); a path that
    two plugins return, or one that leaves ``plugin_files/``, is an error naming the plugins.
    On resume, ``posttrain_restore_checkpoint_files`` hands the files back. This is the only
    way for a plugin to put a file into a checkpoint: a file added to a complete checkpoint
    (after its manifest, e.g. from ``posttrain_checkpoint_saved``) makes resume refuse it.
    Not firstresult: every plugin's dict is written.
    """


@hookspec
def posttrain_restore_checkpoint_files(step: int, files: dict[str, bytes]) -> None:
    """Receive the files contributed through ``posttrain_checkpoint_files`` on resume.

    Called on the driver once when a run resumes from the checkpoint of ``step``, after the
    checkpoint was verified against its manifest and before the first step runs. ``files``
    holds every contributed file of the checkpoint (all plugins'), by the relative path its
    plugin gave; take your own. Not firstresult.
    """


@hookspec
def posttrain_checkpoint_saved(checkpoint_dir: str, manifest: Manifest) -> None:
    """Notify that a complete checkpoint now exists at ``checkpoint_dir``.

    Called on the driver after the atomic rename. For background saves (``trainer.async_save``)
    it runs on the driver's checkpoint finaliser thread while the training loop goes on: an
    implementation that takes long delays only the next save, which waits for this one.
    Use it to upload, or to export other formats *outside* ``checkpoint_dir``: the checkpoint is
    complete and must not change (resume refuses a checkpoint holding a file its manifest does
    not list; add files through ``posttrain_checkpoint_files``). Not firstresult.
    """


# --------------------------------------------------------------------------------------------
# Memory lifecycle for colocated roles (worker processes)
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def posttrain_release_memory(worker: WorkerContext, tags: list[str]) -> bool | None:
    """Free device memory before a colocated role runs (offload, vLLM sleep, SGLang release).

    ``tags`` names what to release (``weights``, ``kv_cache``, ``optimizer``, ``grads``).
    Called on every rank of the role. Return True when done.
    """


@hookspec(firstresult=True)
def posttrain_resume_memory(worker: WorkerContext, tags: list[str]) -> bool | None:
    """Bring back what ``posttrain_release_memory`` freed. Called on every rank of the role."""


@hookspec(firstresult=True)
def posttrain_shutdown_worker(worker: WorkerContext) -> bool | None:
    """Release engines and process groups before the worker process exits."""


# --------------------------------------------------------------------------------------------
# Observability (driver)
# --------------------------------------------------------------------------------------------


@hookspec
def posttrain_step_metrics(step: int, metrics: Mapping[str, float]) -> dict[str, float] | None:
    """Contribute scalar metrics (and timings) to step ``step``.

    Called on the driver after every step, once the core's metrics of the step are complete
    (``metrics``, read-only: rewards, losses, ``time/<phase>`` seconds of each phase, ...), and
    before the step enters the history and reaches ``posttrain_log_metrics``. Return
    ``{name: number}``: the metrics are added to the step, so every logger (console line,
    ``metrics.jsonl``, TensorBoard) receives them and the run's history keeps them.
    Name a timing ``time/<phase>`` (seconds) to have it shown beside the core's phases. A name
    the core or another plugin already reported, or a value that is not a real number, is an
    error naming the plugin. Not firstresult: every plugin's dict is merged.
    """


@hookspec
def posttrain_add_loggers() -> dict[str, LoggerSpec]:
    """Declare metric loggers (experiment trackers): ``{name: LoggerSpec}``.

    Called on the driver when a workflow is validated (every name in ``trainer.logger`` must
    be declared; a logger's ``trainer.logger_args`` entry is structured into the spec's
    ``config_class``) and once when a run starts, after its resumed state is loaded. For each
    name in ``trainer.logger`` the driver then calls the spec's factory with a
    :class:`posttrain.LoggerContext` and registers the returned object as a plugin for the
    run: it receives ``posttrain_log_metrics`` every step and ``posttrain_run_finished`` at
    the end. Must not import the tracker's library: ``posttrain validate`` calls it (give the
    factory as ``"module:attr"``, imported when the run starts). The core's ``trylast``
    implementation provides ``console``, ``jsonl`` and ``tensorboard``. Not firstresult: the
    host merges every plugin's dict; a name declared by two plugins is an error naming both.
    """


@hookspec
def posttrain_log_metrics(step: int, metrics: dict[str, float], run_dir: str) -> None:
    """Receive one step's scalar metrics.

    Called on the driver after every step, with the core's metrics and those plugins added
    through ``posttrain_step_metrics``. The loggers named in ``trainer.logger`` (built by
    ``posttrain_add_loggers``' factories) are plugins implementing this; a plugin may also
    implement it directly, to receive every run's metrics whatever the workflow names.
    Receive, do not change: to add metrics, implement ``posttrain_step_metrics``. Not
    firstresult.
    """


@hookspec
def posttrain_run_finished(run_dir: str, history: list[dict[str, float]]) -> None:
    """Notify that a run ended normally; ``history`` holds every step's metrics.

    Called on the driver once. The core's plotting plugin writes the reward/KL/entropy PNG here.
    """


# --------------------------------------------------------------------------------------------
# Environments (driver)
# --------------------------------------------------------------------------------------------


@hookspec
def posttrain_add_environments() -> dict[str, EnvironmentSpec]:
    """Declare environments for multi-turn episodes: ``{name: EnvironmentSpec}``.

    Called on the driver when a workflow is validated (``environment.name`` must name one; its
    ``environment.kwargs`` are structured into the spec's ``config_class``) and when a run
    starts its first episodes. The spec's factory builds one
    :class:`posttrain.Environment` per episode on the driver; tools are
    environments too (:class:`posttrain.ToolEnvironment`). Must not import
    heavy packages: ``posttrain validate`` calls it (a ``"module:attr"`` factory is imported
    only when a run needs it). The core's ``trylast`` implementation provides ``calculator``.
    Not firstresult: the host merges every plugin's dict; a name declared by two plugins is an
    error naming both.
    """
