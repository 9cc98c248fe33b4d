"""Which roles share devices, and the time-sharing of colocated roles."""

from __future__ import annotations

from posttrain.launcher.base import WorkerGroup


def colocated(a: WorkerGroup, b: WorkerGroup) -> bool:
    return bool(set(a.devices) & set(b.devices))


class TimeSharing:
    """Before a role runs, colocated roles release their memory; a released role resumes when
    it runs again (offload / vLLM sleep / SGLang release through the lifecycle hooks)."""

    TAGS = ["weights", "kv_cache", "optimizer", "grads"]

    def __init__(self, groups: dict[str, WorkerGroup], enabled: bool):
        self.groups = groups
        self.enabled = enabled
        self.released: set[str] = set()

    def activate(self, role: str) -> None:
        if not self.enabled:
            return
        me = self.groups[role]
        for name, other in self.groups.items():
            if name != role and name not in self.released and colocated(me, other):
                other.call("release_memory", self.TAGS)
                self.released.add(name)
        if role in self.released:
            me.call("resume_memory", self.TAGS)
            self.released.discard(role)
