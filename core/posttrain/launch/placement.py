"""Which roles share devices, and the time-sharing of colocated roles."""

from __future__ import annotations

from posttrain.launch.base import WorkerGroup


class TimeSharing:
    """Before a role runs, colocated roles release their memory; a released role resumes when
    it runs again (offload / vLLM sleep / SGLang release through the lifecycle hooks)."""

    TAGS = ["weights", "kv_cache", "optimizer", "grads"]

    def __init__(self, groups: dict[str, WorkerGroup], enabled: bool):
        self.groups = groups
        self.enabled = enabled
        self.released: set[str] = set()

    def activate(self, *roles: str) -> None:
        """Make ``roles`` resident (a weight sync needs trainer and rollout at once); release
        every other role that shares a device with one of them."""
        if not self.enabled:
            return
        active = [self.groups[r] for r in roles]
        for name, other in self.groups.items():
            if name in roles or name in self.released:
                continue
            if any(me.shares_devices_with(other) for me in active):
                other.call("release_memory", self.TAGS)
                self.released.add(name)
        for role in roles:
            if role in self.released:
                self.groups[role].call("resume_memory", self.TAGS)
                self.released.discard(role)
