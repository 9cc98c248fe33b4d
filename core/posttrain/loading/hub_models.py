"""Models a workflow names by hub id (neither a preset nor a local path): found in the local HF
cache, or on a hub that answers, before any process starts.

Every command refuses a name that is neither a path nor a valid hub id. ``posttrain validate``
looks only in the cache (no network): an id it cannot find there is a warning, since a run may
still download it. ``posttrain run`` and ``posttrain eval`` ask the hub
once (one metadata request, no retries) about an id the cache lacks: without the check,
transformers retries for about 50 s in the driver and ends with a traceback, after the run
directory was made.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import attrs

from posttrain.config.report import ErrorReport, join_path
from posttrain.errors import UserError
from posttrain.tasks.presets import is_preset

if TYPE_CHECKING:
    from posttrain.config.sections import Workflow

# What a load reads first from the hub, by the model_args key naming the repository.
FIRST_FILE = {
    "model_name_or_path": "config.json",
    "tokenizer_name_or_path": "tokenizer_config.json",
}
# One metadata request; a hub that takes longer is as good as unreachable for a run start.
HUB_TIMEOUT_S = 10.0


@attrs.frozen
class HubModel:
    repo_id: str
    where: str  # the YAML path that names it (the top-level model_args' when it is set there)
    filename: str  # the file a load reads first (FIRST_FILE)


def looks_local(name_or_path: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else is meant as a local path."""
    return name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1


def hub_models(workflow: Workflow) -> list[HubModel]:
    """Each hub id of the workflow's roles (model and tokenizer), once."""
    found: dict[tuple[str, str], HubModel] = {}
    for name, role in workflow.roles().items():
        for key, filename in FIRST_FILE.items():
            value = getattr(role.model_args, key)
            if not value or is_preset(value) or looks_local(value):
                continue
            local = value if os.path.isabs(value) else os.path.join(workflow.base_dir, value)
            if os.path.exists(local):
                continue
            top = getattr(workflow.model_args, key) == value
            where = join_path("model_args", key) if top else join_path(name, "model_args", key)
            found.setdefault((value, filename), HubModel(value, where, filename))
    return list(found.values())


def in_cache(model: HubModel) -> bool:
    """Whether the local HF cache holds the model (its first file, at the ``main`` revision)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model.repo_id, model.filename), str)


def invalid_id(repo_id: str) -> str:
    """Why ``repo_id`` cannot be a hub id ("" when it can)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return str(exc)
    return ""


def _download_hint(repo_id: str) -> str:
    return (
        f"download it where the hub is reachable (hf download {repo_id}, or huggingface-cli "
        "download) and run with HF_HUB_OFFLINE=1, or give a local model directory"
    )


def check_hub_ids(workflow: Workflow, report: ErrorReport) -> None:
    """A name that is neither a local path nor a valid hub id is an error (before any process:
    the hub would refuse it after transformers' retries)."""
    for model in hub_models(workflow):
        problem = invalid_id(model.repo_id)
        if problem:
            report.error(
                model.where,
                f"'{model.repo_id}' is neither a local path nor a hub id: {problem}",
                "give an HF model directory, a hub id (org/name) or a preset (preset:NAME)",
            )


def warn_uncached(workflow: Workflow, report: ErrorReport) -> None:
    """``posttrain validate``: a hub id the local cache lacks is a warning (no network is used;
    a run asks the hub itself, :func:`check_reachable`)."""
    from huggingface_hub import constants

    for model in hub_models(workflow):
        if not invalid_id(model.repo_id) and not in_cache(model):
            report.warn(
                model.where,
                f"'{model.repo_id}' is not a local directory and not in the HF cache "
                f"({constants.HF_HUB_CACHE}): a run downloads it from {constants.ENDPOINT}",
                f"to run without the hub: hf download {model.repo_id} first, then HF_HUB_OFFLINE=1",
            )


def check_reachable(workflow: Workflow) -> None:
    """``posttrain run`` and ``eval``: every hub id is in the local cache or on the hub, asked
    once; else a :class:`UserError` saying what was looked for and what to do."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils import httpx  # huggingface_hub's own transport, whichever it is

    for model in hub_models(workflow):
        if in_cache(model):
            continue
        looked = (
            f"{model.where}: '{model.repo_id}' is not a local directory and not in the HF cache "
            f"({constants.HF_HUB_CACHE})"
        )
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{looked}, and HF_HUB_OFFLINE is set; {_download_hint(model.repo_id)}")
        try:
            HfApi().model_info(model.repo_id, timeout=HUB_TIMEOUT_S)
        except GatedRepoError:
            raise UserError(
                f"{looked}, and it is gated on {constants.ENDPOINT}: accept its terms on its "
                "page and log in (hf auth login), or give a local model directory"
            ) from None
        except RepositoryNotFoundError:
            raise UserError(
                f"{looked}, and {constants.ENDPOINT} has no such model: check the name for a "
                "typo (a private model needs hf auth login), or give a local model directory"
            ) from None
        except (httpx.TransportError, OfflineModeIsEnabled, HfHubHTTPError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(
                f"{looked}, and the hub {constants.ENDPOINT} cannot be reached ({reason}); "
                f"{_download_hint(model.repo_id)}"
            ) from None
