"""Which roles share devices, and the time-sharing of colocated roles."""

from __future__ import annotations

import logging

from posttrain.launch.base import WorkerGroup

log = logging.getLogger(__name__)


class TimeSharing:
    """Before a role runs, colocated roles release their memory; a released role resumes when
    it runs again (offload / vLLM sleep / SGLang release through the lifecycle hooks)."""

    TAGS = ["weights", "kv_cache", "optimizer", "grads"]

    def __init__(self, groups: dict[str, WorkerGroup], enabled: bool):
        self.groups = groups
        self.enabled = enabled
        self.released: set[str] = set()
        self._unanswered: set[tuple[str, str]] = set()

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
                self._check_answers(
                    other, "release_memory", other.call("release_memory", self.TAGS)
                )
                self.released.add(name)
        for role in roles:
            if role in self.released:
                group = self.groups[role]
                self._check_answers(group, "resume_memory", group.call("resume_memory", self.TAGS))
                self.released.discard(role)

    def _check_answers(self, group: WorkerGroup, call: str, answers: list[object]) -> None:
        # None: no hook answered, so the role's memory stayed where it was while another role
        # ran on its devices. Said once per role and call: the run goes on, more slowly or
        # nearer the card's limit, as it did before anyone asked.
        key = (group.role, call)
        if key in self._unanswered or not any(answer is None for answer in answers):
            return
        self._unanswered.add(key)
        strategy = group.spec.config.strategy_args.strategy_name
        log.warning(
            "%s (%s) implements no %s: its memory stays on the GPUs it shares with the other "
            "roles (docs/plugin-guide.md, worker hooks)",
            group.role,
            strategy,
            call,
        )
