"""The checkpoint manifest: what was saved, by which strategy and layout, with file checksums."""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from posttrain.errors import DamagedCheckpoint
from posttrain.paths import display_path

if TYPE_CHECKING:
    from collections.abc import Iterable

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@attrs.define(kw_only=True)
class Manifest:
    step: int
    roles: dict[str, dict[str, Any]]
    versions: dict[str, str]
    files: dict[str, str] = attrs.field(factory=dict)  # relative path -> sha256
    format_version: int = FORMAT_VERSION

    def write(self, directory: str) -> None:
        path = os.path.join(directory, MANIFEST)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(attrs.asdict(self), f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: str) -> Manifest:
        path = os.path.join(directory, MANIFEST)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return cls(**data)
        except FileNotFoundError:
            raise DamagedCheckpoint(
                f"{display_path(directory)} is not a complete checkpoint: {MANIFEST} is missing"
            ) from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise DamagedCheckpoint(f"{display_path(path)} is corrupted ({exc})") from None


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksum_tree_paths(directory: str) -> list[str]:
    """Every file under ``directory`` but the manifest, relative, sorted."""
    out = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def checksum_tree(directory: str, known: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every file under ``directory`` (the manifest excepted). ``known`` holds digests
    computed while the files were written (relative paths); only the other files are read."""
    known = known or {}
    return {
        rel: known[rel] if rel in known else sha256_file(os.path.join(directory, rel))
        for rel in checksum_tree_paths(directory)
    }


def verify(directory: str) -> Manifest:
    """The manifest, after checking that every listed file exists with its checksum and that
    no other file is there: a file added to a complete checkpoint was never checksummed, so
    nothing says it is the one its writer meant."""
    manifest = Manifest.read(directory)
    unlisted = sorted(set(checksum_tree_paths(directory)) - set(manifest.files))
    if unlisted:
        raise DamagedCheckpoint(
            f"checkpoint {display_path(directory)}: {', '.join(unlisted[:5])} "
            f"{'is' if len(unlisted) == 1 else 'are'} not listed in its {MANIFEST} (added after "
            "the checkpoint was complete); remove what was added, or resume from another "
            "checkpoint. Plugins add files through posttrain_checkpoint_files."
        )
    for rel, expected in manifest.files.items():
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            shown = display_path(directory)
            raise DamagedCheckpoint(f"checkpoint {shown}: file {rel} is missing")
        if sha256_file(full) != expected:
            raise DamagedCheckpoint(
                f"checkpoint {display_path(directory)}: file {rel} is corrupted "
                "(sha256 does not match the manifest)"
            )
    return manifest


class _Distributed(Protocol):
    # What package_versions reads of the plugin host's PluginInfo (which it cannot name: the
    # hook specifications name Manifest, and the plugin host imports them).
    distribution: str
    version: str


def package_versions(plugins: Iterable[_Distributed]) -> dict[str, str]:
    """The versions a manifest records: posttrain, torch, transformers and every plugin's
    distribution (``plugins``: the plugin host's ``PluginInfo`` list)."""
    import importlib.metadata

    versions: dict[str, str] = {}
    for dist in ("posttrain", "torch", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    for info in plugins:
        if info.distribution and info.version:
            versions[info.distribution] = info.version
    return versions
