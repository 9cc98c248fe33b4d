"""Colocated roles' time-sharing: a role that implements no release_memory (or resume_memory)
is said once, not silently kept resident. FAKE groups (core contract test): they record calls
and answer as a strategy with or without the hooks would."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from posttrain.launch.placement import TimeSharing


class ContractFakeGroup:
    def __init__(self, role: str, strategy: str, answer: bool | None):
        self.role = role
        self.spec = SimpleNamespace(
            config=SimpleNamespace(strategy_args=SimpleNamespace(strategy_name=strategy))
        )
        self.answer = answer
        self.calls: list[str] = []

    def shares_devices_with(self, other) -> bool:
        return True

    def call(self, method: str, *args):
        self.calls.append(method)
        return [self.answer, self.answer]


def test_a_role_without_memory_hooks_is_named_once(caplog):
    trainer = ContractFakeGroup("actor_train", "contract_fake_no_hooks", None)
    rollout = ContractFakeGroup("actor_infer", "contract_fake_rollout", True)
    sharing = TimeSharing({"actor_train": trainer, "actor_infer": rollout}, enabled=True)
    with caplog.at_level(logging.WARNING, logger="posttrain.launch.placement"):
        for _ in range(2):
            sharing.activate("actor_infer")
            sharing.activate("actor_train")
    assert trainer.calls == ["release_memory", "resume_memory"] * 2
    assert rollout.calls == ["release_memory", "resume_memory", "release_memory"]
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "actor_train (contract_fake_no_hooks) implements no release_memory: its memory stays "
        "on the GPUs it shares with the other roles (docs/plugin-guide.md, worker hooks)",
        "actor_train (contract_fake_no_hooks) implements no resume_memory: its memory stays "
        "on the GPUs it shares with the other roles (docs/plugin-guide.md, worker hooks)",
    ]
