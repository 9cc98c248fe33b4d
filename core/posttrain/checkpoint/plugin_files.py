"""Files that plugins put into checkpoints (``posttrain_checkpoint_files``): checked, written
under ``plugin_files/`` with the rest of the checkpoint and hashed while written, so that the
manifest lists them and resume verifies them; handed back on resume."""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

from posttrain.checkpoint.digests import FileDigests
from posttrain.errors import PluginError

if TYPE_CHECKING:
    from posttrain.host.plugin_host import PluginHost

PLUGIN_FILES = "plugin_files"


def collect(host: PluginHost, step: int, run_dir: str) -> dict[str, bytes]:
    """Every plugin's files for the checkpoint of ``step``, by relative path."""
    files: dict[str, bytes] = {}
    owners: dict[str, str] = {}
    for plugin, answer in host.answers_by_plugin(
        "posttrain_checkpoint_files", step=step, run_dir=run_dir
    ):
        if not isinstance(answer, dict):
            raise PluginError(
                f"plugin '{plugin}': posttrain_checkpoint_files returned "
                f"{type(answer).__name__}; expected a dict of relative path -> bytes"
            )
        for path, content in answer.items():
            _check(plugin, path, content)
            if path in owners:
                raise PluginError(
                    f"checkpoint file '{path}' is contributed by two plugins: "
                    f"'{owners[path]}' and '{plugin}'; each should prefix its paths with its name"
                )
            owners[path] = plugin
            files[path] = bytes(content)
    return files


def _check(plugin: str, path: object, content: object) -> None:
    normal = posixpath.normpath(path) if isinstance(path, str) else ""
    if (
        not normal
        or normal != path
        or normal.startswith(("/", "../"))
        or normal in (".", "..")
        or "\\" in path
    ):
        raise PluginError(
            f"plugin '{plugin}': checkpoint file path {path!r} must be a normalised relative "
            "path with '/' separators, inside the checkpoint (e.g. 'myplugin/state.json')"
        )
    if not isinstance(content, bytes | bytearray | memoryview):
        raise PluginError(
            f"plugin '{plugin}': checkpoint file '{path}' has content of type "
            f"{type(content).__name__}; expected bytes"
        )


def write(tmp: str, files: dict[str, bytes]) -> dict[str, str]:
    """Write ``files`` under ``tmp/plugin_files``; return their sha256 by path relative to
    ``tmp``, computed while writing."""
    root = os.path.join(tmp, PLUGIN_FILES)
    digests = FileDigests(tmp)
    for path, content in files.items():
        full = os.path.join(root, *path.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with digests.open(full) as f:
            f.write(content)
    return digests.relative()


def read(checkpoint_dir: str, listed: dict[str, str]) -> dict[str, bytes]:
    """The contributed files of a verified checkpoint (``listed``: its manifest's files)."""
    prefix = PLUGIN_FILES + "/"
    files = {}
    for rel in listed:
        rel_posix = rel.replace(os.sep, "/")
        if rel_posix.startswith(prefix):
            with open(os.path.join(checkpoint_dir, rel), "rb") as f:
                files[rel_posix[len(prefix) :]] = f.read()
    return files
