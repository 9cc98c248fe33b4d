"""The broadcast transport hands a rollout rank's place to an engine that receives itself
(``posttrain_weight_receiver``): the rank-side functions call the receiver, not torch, and the
rank reads each bucket's metadata from the sync group's store (streaming, no driver call)."""

from __future__ import annotations

from types import SimpleNamespace

from posttrain.weight_sync import rank_side
from posttrain.weight_sync.verify import SyncState


class RecordingReceiver:
    def __init__(self):
        self.calls = []

    def join(self, address, port, rank, world_size, group_name, timeout_s):
        self.calls.append(("join", address, port, rank, world_size, group_name, timeout_s))

    def receive(self, meta, group_name):
        self.calls.append(("receive", meta, group_name))
        return True

    def leave(self, group_name):
        self.calls.append(("leave", group_name))


def _runtime(receiver):
    asked = []

    def posttrain_weight_receiver(worker):
        asked.append(worker)
        return receiver

    hook = SimpleNamespace(posttrain_weight_receiver=posttrain_weight_receiver)
    ctx = SimpleNamespace(device="cpu", state={}, sync=SyncState(), hook=hook)
    return SimpleNamespace(ctx=ctx), asked


def test_receiver_takes_the_rank_s_place_in_the_group():
    import pickle
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The test plays trainer rank 0: it hosts the group's store and publishes the metadata.
    master = dist.TCPStore(
        "127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False
    )
    receiver = RecordingReceiver()
    runtime, asked = _runtime(receiver)
    meta = [("model.norm.weight", (4,), "float32", 16)]
    assert rank_side.join_sync_group(runtime, "127.0.0.1", port, 2, 3, 5.0, "g_1234")
    published = dist.PrefixStore(rank_side.META_PREFIX, master)
    published.set("1/0", pickle.dumps(meta))
    published.set("1/1", pickle.dumps(None))  # the end of sync round 1
    assert rank_side.stream_receive(runtime) == {"bytes": 16, "buckets": 1}
    assert rank_side.receive_and_import(runtime, meta)  # the per-bucket path
    assert rank_side.leave_sync_group(runtime)
    assert asked == [runtime.ctx]
    assert receiver.calls == [
        ("join", "127.0.0.1", port, 2, 3, "g_1234", 5.0),
        ("receive", meta, "g_1234"),
        ("receive", meta, "g_1234"),
        ("leave", "g_1234"),
    ]
    assert runtime.ctx.sync.link is None and runtime.ctx.state == {}  # left: nothing kept


def test_trainer_rank_and_non_members_never_ask_for_a_receiver():
    runtime, asked = _runtime(RecordingReceiver())
    assert rank_side.join_sync_group(runtime, "127.0.0.1", 1, -1, 3)  # not in the group
    assert asked == []


def test_engine_hooks_dispatch_weight_receiver_by_strategy(monkeypatch):
    import sys
    import types

    from posttrain.host.engine_hooks import EngineHooks

    engine = types.ModuleType("fake_receiver_engine")
    engine.weight_receiver = lambda worker: ("receiver of", worker.strategy_name)
    monkeypatch.setitem(sys.modules, "fake_receiver_engine", engine)

    class Plugin(EngineHooks):
        strategies = ("mine",)
        engine = "fake_receiver_engine"

    plugin = Plugin()
    assert plugin.posttrain_weight_receiver(SimpleNamespace(strategy_name="mine")) == (
        "receiver of",
        "mine",
    )
    assert plugin.posttrain_weight_receiver(SimpleNamespace(strategy_name="other")) is None
