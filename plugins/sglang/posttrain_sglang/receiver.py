"""The ``broadcast`` transport's receiving end inside SGLang (``posttrain_weight_receiver``).

With separate devices the core broadcasts each bucket from trainer rank 0 over a sync group
(see :mod:`posttrain.weight_sync.rank_side`). SGLang's scheduler joins that group itself
(``init_weights_update_group``, as group rank ``1 + rollout rank``; with tensor parallelism its
``tp_size`` schedulers hold that rank and the next ones, which belong to the replica's other
ranks) and receives each bucket straight into the engine (``update_weights_from_distributed`` in
the ``flattened_bucket`` layout, which is the core's wire format), so the tensors never pass
through the rank's own process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from posttrain_sglang import calls
from posttrain_sglang.args import is_cuda
from posttrain_sglang.state import rank_state

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine

    from posttrain import WorkerContext
    from posttrain_sglang.calls import BucketMeta

log = logging.getLogger("posttrain.sglang")


class DistributedReceiver:
    def __init__(self, worker: WorkerContext, engine: Engine | None) -> None:
        self.worker = worker
        self.engine = engine  # None on the ranks of a replica that do not drive the engine
        self.timeout_s = 300.0

    def join(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        group_name: str,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        if self.engine is None:
            return
        backend = "nccl" if is_cuda(self.worker) else "gloo"
        calls.init_group(
            self.worker,
            self.engine,
            address,
            port,
            rank,
            world_size,
            group_name,
            backend,
            timeout_s,
        )
        log.info("joined weight-sync group %s as rank %d of %d", group_name, rank, world_size)

    def receive(self, meta: BucketMeta, group_name: str) -> bool:
        if self.engine is None:
            return True
        with calls.weight_update(self.worker, self.engine, self.timeout_s):
            calls.update_from_distributed(
                self.worker, self.engine, meta, group_name, self.timeout_s
            )
        return True

    def leave(self, group_name: str) -> None:
        if self.engine is None or rank_state(self.worker).broken:
            return
        calls.destroy_group(self.worker, self.engine, group_name, self.timeout_s)
