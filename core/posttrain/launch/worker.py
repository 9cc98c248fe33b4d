"""What one rank of a worker group knows, and the calls the driver makes on it.

A :class:`WorkerContext` is handed to every worker hook. Backends keep their engine objects in a
typed object of their own (:meth:`WorkerContext.engine_state`) and their model handle in
``worker.model``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs

from posttrain.algorithms.policy_loss import PolicyLoss
from posttrain.algorithms.registry import policy_loss_term
from posttrain.algorithms.value_loss import ValueLoss
from posttrain.config.sections import AlgorithmConfig, GeneratingArgs, ModelArgs, TrainingArgs
from posttrain.errors import DeviceOutOfMemory, PosttrainError, UserError
from posttrain.weight_sync.verify import SyncState

if TYPE_CHECKING:
    import torch

    from posttrain.protocol import GenerationRequest, RolloutSamples, SequenceBatch, WeightBucket

StateT = TypeVar("StateT")


@attrs.define(kw_only=True)
class WorkerContext:
    role: str
    strategy_name: str
    config: Any  # the strategy's structured strategy_config
    model_args: ModelArgs
    training_args: TrainingArgs | None = None
    generating_args: GeneratingArgs | None = None
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    seed: int = 42
    run_dir: str = ""
    base_dir: str = "."
    # Algorithm settings the backend needs for its loss (e.g. micro-batch normalisation).
    algorithm: AlgorithmConfig | None = None
    hook: Any = None  # the plugin host's hook relay (pluggy.HookRelay), to call other hooks
    # Rows a rollout or scoring role handles at once: the role's ``infer_batch_size``, or None
    # where the workflow leaves it to the strategy.
    infer_batch_size: int | None = None
    # The model head this role loads: "lm" (a causal LM: actor, reference, rollout), "value"
    # (the critic: posttrain_compute_values) or "score" (a reward model:
    # posttrain_compute_scores).
    head: str = "lm"
    parallel: dict[str, int] = attrs.field(factory=dict)
    model: Any = None
    # The backend's own, between calls: its typed state objects (engine_state), by class. Core
    # keeps nothing here.
    state: dict[Any, Any] = attrs.field(factory=dict)
    # Core's between two weight syncs (posttrain.weight_sync.verify).
    sync: SyncState = attrs.field(factory=SyncState)

    def engine_state(self, cls: type[StateT]) -> StateT:
        """This role's instance of ``cls``, the backend's own typed state (its engine objects
        between calls): made by ``cls()`` on the first call, the same object after it. A plugin
        declares one attrs class with a default for every field and reads its state through
        it, so mypy checks every use; core never reads it."""
        found = self.state.get(cls)
        if found is None:
            found = self.state[cls] = cls()
        return found

    @property
    def metric_prefix(self) -> str:
        """Prefix of this role's training metrics: ``critic/...`` or ``actor/...``."""
        return "critic" if self.head == "value" else "actor"

    @property
    def dp_rank(self) -> int:
        return self.parallel.get("dp_rank", self.rank)

    @property
    def dp_size(self) -> int:
        return self.parallel.get("dp_size", self.world_size)

    def require_training_args(self) -> TrainingArgs:
        """``training_args`` of a trained role (validation asks every trained role for them)."""
        if self.training_args is None:
            raise UserError(
                f"role {self.role}: {self.strategy_name} trains and needs training_args"
            )
        return self.training_args

    def resolve_path(self, path: str) -> str:
        import os

        return path if os.path.isabs(path) else os.path.join(self.base_dir, path)


# call_stats' entry for the process as a whole (no hook has this name).
PROCESS_STATS = "_process"


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class NoImplementationError(PosttrainError):
    pass


class WorkerRuntime:
    """The methods a launcher invokes on a rank; each one calls the strategy's hook.

    ``peers`` maps every role hosted by this rank's process to its runtime (this one included):
    rank-side code such as the in-process weight transport reaches the other roles through it.
    """

    # Per hook since the driver last asked (call_stats): the seconds spent in it on this rank
    # and the peak GPU memory (bytes) of this process's device (one process drives one GPU,
    # whatever roles it hosts).
    _seconds: ClassVar[dict[str, float]] = {}
    _peaks: ClassVar[dict[str, int]] = {}

    def __init__(self, ctx: WorkerContext, peers: dict[str, WorkerRuntime] | None = None):
        self.ctx = ctx
        self.peers = peers if peers is not None else {ctx.role: self}
        self._export: Iterator[WeightBucket] | None = None
        # What the engine takes in a sync, asked once (posttrain_weight_shapes; None: unsaid).
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._shapes_asked = False

    def _call(self, hook_name: str, **kwargs: Any) -> Any:
        on_gpu = str(self.ctx.device).startswith("cuda")
        if on_gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        name = hook_name.removeprefix("posttrain_")
        try:
            result = getattr(self.ctx.hook, hook_name)(worker=self.ctx, **kwargs)
        except Exception as exc:
            import torch

            if isinstance(exc, torch.OutOfMemoryError):
                raise out_of_memory(self.ctx.role, name, exc) from exc
            raise
        self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start
        if on_gpu:
            peak = torch.cuda.max_memory_allocated()
            self._peaks[name] = max(peak, self._peaks.get(name, 0))
        if result is None:
            raise NoImplementationError(
                f"no installed plugin implements {hook_name} for strategy "
                f"'{self.ctx.strategy_name}' (role {self.ctx.role})"
            )
        return result

    def setup(self) -> dict[str, int]:
        self.ctx.parallel = dict(self._call("posttrain_setup_parallel"))
        self.ctx.model = self._call("posttrain_load_model")
        return self.ctx.parallel

    def generate(self, request: GenerationRequest) -> RolloutSamples:
        return self._call("posttrain_generate", request=request)

    def compute_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        return self._call("posttrain_compute_logprobs", batch=batch)

    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        return self._call("posttrain_compute_values", batch=batch)

    def compute_scores(self, batch: SequenceBatch) -> torch.Tensor:
        return self._call("posttrain_compute_scores", batch=batch)

    def train_step(self, batch: SequenceBatch) -> dict[str, float]:
        loss_fn: ValueLoss | PolicyLoss
        if self.ctx.head == "value":
            loss_fn = ValueLoss(self.ctx.algorithm)
        else:
            algorithm = self.ctx.algorithm
            if algorithm is None:  # launchers give every role the workflow's algorithm section
                raise PosttrainError(
                    f"train_step of role {self.ctx.role}: its WorkerContext has no algorithm"
                )
            loss_fn = PolicyLoss(algorithm, policy_loss_term(algorithm, self.ctx.hook))
        return self._call("posttrain_train_step", batch=batch, loss_fn=loss_fn)

    def export_weights(self, bucket_bytes: int, on_device: bool) -> Iterator[WeightBucket]:
        """The export hook's bucket iterator (see ``posttrain_export_weights``)."""
        return iter(
            self._call("posttrain_export_weights", bucket_bytes=bucket_bytes, on_device=on_device)
        )

    def export_begin(self, bucket_bytes: int, verify: str = "first") -> None:
        from posttrain.weight_sync.verify import begin_sync

        begin_sync(self.ctx.sync, verify)
        self._export = self.export_weights(bucket_bytes, on_device=False)

    def export_next(self) -> WeightBucket | None:
        """The next bucket (empty on ranks that do not hold the gathered weights) or None."""
        if self._export is None:
            raise PosttrainError("export_next called before export_begin")
        bucket = next(self._export, None)
        if bucket is None:
            self._export = None
        return bucket

    def import_weights(self, buckets: Iterable[WeightBucket]) -> bool:
        """Load ``buckets`` into this role's engine, each bucket that carries the trainer's byte
        sums checked first (posttrain.weight_sync.verify)."""
        from posttrain.weight_sync.verify import checked

        where = f"{self.ctx.role} ({self.ctx.strategy_name}) rank {self.ctx.rank}"
        buckets = checked(self.ctx.sync, buckets, where, self._engine_shapes)
        return self._call("posttrain_import_weights", buckets=buckets)

    def _engine_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """The names and shapes the engine takes in a sync (``posttrain_weight_shapes``), asked
        once; None where the engine does not say."""
        if not self._shapes_asked:
            self._shapes = self.ctx.hook.posttrain_weight_shapes(worker=self.ctx)
            self._shapes_asked = True
        return self._shapes

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        return self._call("posttrain_save_checkpoint", path=path)

    def begin_checkpoint(self, path: str, background: bool) -> dict[str, Any]:
        """Start this role's save into ``path``: in the background when asked and the strategy
        can (``posttrain_begin_checkpoint``), else synchronously. ``{"layout": ...,
        "background": bool}``: with True the rank's completion marker tells when it is done."""
        if background:
            layout = self.ctx.hook.posttrain_begin_checkpoint(worker=self.ctx, path=path)
            if layout is not None:
                return {"layout": layout, "background": True}
        return {"layout": self.save_checkpoint(path), "background": False}

    def finish_checkpoint(self, path: str) -> bool:
        """Wait for the background save into ``path`` (a no-op for synchronous ones)."""
        return bool(self.ctx.hook.posttrain_finish_checkpoint(worker=self.ctx, path=path))

    def load_checkpoint(self, path: str) -> bool:
        return self._call("posttrain_load_checkpoint", path=path)

    def export_hf(self, path: str, merge: bool = False) -> bool:
        return self._call("posttrain_export_hf", path=path, merge=merge)

    def release_memory(self, tags: list[str]) -> bool:
        return self._call("posttrain_release_memory", tags=tags)

    def resume_memory(self, tags: list[str]) -> bool:
        return self._call("posttrain_resume_memory", tags=tags)

    def shutdown(self) -> bool:
        return bool(self.ctx.hook.posttrain_shutdown_worker(worker=self.ctx))

    def call_stats(self) -> dict[str, dict[str, float]]:
        """Per hook (``generate``, ``train_step``, ...) since the last ask: ``seconds`` spent in
        it on this rank, and on a GPU the ``peak_bytes`` of device memory; under
        ``PROCESS_STATS`` the process's resident memory now (``rss_bytes``)."""
        stats = {
            name: {
                "seconds": seconds,
                **({"peak_bytes": self._peaks[name]} if name in self._peaks else {}),
            }
            for name, seconds in self._seconds.items()
        }
        stats[PROCESS_STATS] = {"rss_bytes": resident_bytes()}
        self._seconds.clear()
        self._peaks.clear()
        return stats

    def ping(self) -> str:
        return "pong"


def out_of_memory(role: str, call: str, exc: BaseException) -> DeviceOutOfMemory:
    """A rank's CUDA out-of-memory error as the user's (exit 2, no traceback): the role, the
    call, the peak this call reached and the card's size; the driver adds the knobs."""
    import torch

    where = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = torch.cuda.max_memory_allocated() / 2**30
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        where = f": peak {peak:.1f} of {total / 2**30:.1f} GiB"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DeviceOutOfMemory(
        f"{role} ran out of GPU memory in {call}{where} ({first}); `posttrain plan WORKFLOW` "
        "shows where the memory goes"
    )
