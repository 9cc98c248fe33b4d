"""Error types that separate user mistakes (exit 2, no traceback) from internal failures."""

from __future__ import annotations


class PosttrainError(Exception):
    """Base of posttrain's own errors."""


class UserError(PosttrainError):
    """A mistake in the user's input (workflow, CLI arguments, files): exit code 2, no traceback."""


class PluginError(UserError):
    """A plugin could not be loaded or conflicts with another plugin."""


class PluginWarning(UserWarning):
    """A plugin loads, but part of it looks like a mistake that would fail silently (e.g. an
    engine function that :class:`~posttrain.host.engine_hooks.EngineHooks` never calls)."""


class WorkerError(PosttrainError):
    """A worker rank raised; carries the role, the rank and the remote traceback."""

    def __init__(
        self,
        role: str,
        rank: int,
        message: str,
        remote_traceback: str = "",
        roles: tuple[str, ...] = (),
        user_error: bool = False,
    ):
        # ``roles``: every role hosted by the failed rank's process (hybrid engine); a dead
        # process takes all of them down, so the message names them all.
        shared = f" (its process also hosted {', '.join(r for r in roles if r != role)})"
        where = shared if len(roles) > 1 else ""
        super().__init__(f"{role} rank {rank}{where}: {message}")
        self.role = role
        self.rank = rank
        self.roles = roles or (role,)
        self.remote_traceback = remote_traceback
        # The rank raised a UserError (e.g. out of GPU memory): exit 2, no traceback.
        self.user_error = user_error
        self.hint = ""  # what to do next (a run's: how a rerun resumes), shown last


class DeviceOutOfMemory(UserError):
    """A rank ran out of GPU memory: the workflow asks for more than the card holds."""


class CheckpointError(UserError):
    """A checkpoint is incomplete, corrupted or does not match the workflow."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's files do not match its manifest: one is missing, corrupted or added."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C; the message says what a rerun resumes from (exit code 130)."""
