"""Load a workflow file into typed sections, collecting every error before anything starts."""

from __future__ import annotations

import os
import typing
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.converter import structure_into
from posttrain.config.report import ErrorReport, did_you_mean, join_path, unknown_name_hint
from posttrain.config.sections import ROLE_NAMES, SECTION_ROLES, ModelArgs, Workflow
from posttrain.config.yaml_loader import load_yaml_text
from posttrain.errors import UserError
from posttrain.host.references import import_beside
from posttrain.host.strategy import KNOWN_PROVIDERS
from posttrain.loading.lora_sync import resolve_lora_sync
from posttrain.paths import display_path
from posttrain.rollout.environments.validation import check_environment
from posttrain.trainer.logger_registry import check_loggers

if TYPE_CHECKING:
    from posttrain.host.plugin_host import PluginHost


def read_workflow_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"workflow file not found: {display_path(path)}") from None
    except IsADirectoryError:
        shown = display_path(path)
        raise UserError(f"{shown} is a directory; give the workflow's YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read workflow {display_path(path)}: {exc}") from None


def load_workflow(
    path: str,
    host: PluginHost,
    overrides: dict[str, Any] | None = None,
    report: ErrorReport | None = None,
) -> tuple[Workflow | None, ErrorReport]:
    """Parse, structure and check ``path``. Returns the workflow (None if it could not be built)
    and the report; the caller decides what to do with errors."""
    report = report or ErrorReport()
    raw = load_yaml_text(read_workflow_file(path), path, report)
    if raw is None and report:  # a syntax error; duplicate keys still let the checks go on
        return None, report
    base_dir = os.path.dirname(os.path.abspath(path))
    return build_workflow(raw, host, report, base_dir=base_dir, overrides=overrides)


def build_workflow(
    raw: Any,
    host: PluginHost,
    report: ErrorReport,
    *,
    base_dir: str = ".",
    overrides: dict[str, Any] | None = None,
) -> tuple[Workflow | None, ErrorReport]:
    if not raw or not isinstance(raw, dict):
        report.error(
            "",
            f"no workflow: {_what_it_holds(raw)}",
            "a workflow maps sections such as model_args:, actor_train:, actor_infer:, "
            "trainer:; see examples/quickstart.yaml",
        )
        return None, report
    raw = _apply_overrides(raw, overrides or {}, report)
    raw = _merge_model_args(raw)
    import_beside(base_dir)  # the modules the workflow names may lie next to it

    plugin_names = raw.get("plugins") or []
    if isinstance(plugin_names, list):
        for index, message, hint in host.load_workflow_plugins(
            [p for p in plugin_names if isinstance(p, str)]
        ):
            report.error(join_path("plugins", index), message, hint)

    sections: dict[str, Any] = {}
    fields = {f.name: f for f in attrs.fields(Workflow) if f.name != "base_dir"}
    for key, value in raw.items():
        if key not in fields:
            report.error(str(key), "unknown section", did_you_mean(str(key), fields))
            continue
        structured = structure_into(value, _SECTION_TYPES[key], key, report)
        if structured is not None:
            sections[key] = structured
        elif value is not None:
            report.failed_sections.add(key)
    workflow = Workflow(**sections, base_dir=base_dir)
    workflow = _structure_strategy_configs(workflow, raw, host, report)
    try:
        strategies = host.strategies()
    except UserError:
        strategies = {}  # the conflict was reported by _structure_strategy_configs
    host.hook.posttrain_validate_workflow(
        workflow=workflow, strategies=strategies, report=report, hook=host.hook
    )
    # These two structure their sections with the class their plugin names (as the strategy
    # configs above), so they return a new workflow rather than only check it.
    workflow = check_environment(workflow, raw.get("environment"), host.hook, strategies, report)
    workflow = check_loggers(workflow, host.hook, report)
    return resolve_lora_sync(workflow, strategies), report


_SECTION_TYPES = typing.get_type_hints(Workflow)


def _what_it_holds(raw: Any) -> str:
    if raw is None:
        return "the file is empty or holds only comments"
    if isinstance(raw, dict):
        return "the file holds an empty mapping"
    kind = "a list" if isinstance(raw, list) else f"the value {str(raw)[:40]!r}"
    return f"the file holds {kind}, not a mapping of sections"


def _merge_model_args(raw: dict) -> dict:
    """Top-level ``model_args`` are defaults; a role's own ``model_args`` override them."""
    top = raw.get("model_args")
    if not isinstance(top, dict):
        return raw
    top = _inheritable(top)
    merged = dict(raw)
    for role in ROLE_NAMES:
        block = raw.get(role)
        if isinstance(block, dict):
            own = block.get("model_args")
            if own is None or isinstance(own, dict):
                merged[role] = {**block, "model_args": {**top, **(own or {})}}
    return merged


def _inheritable(top: dict) -> dict:
    """The top-level model_args that are valid on their own: a bad one is reported once, at its
    own path, not again under every role that inherits it."""
    names = {f.name for f in attrs.fields(ModelArgs)}
    return {
        key: value
        for key, value in top.items()
        if key in names and structure_into({key: value}, ModelArgs, "", ErrorReport()) is not None
    }


def _apply_overrides(raw: dict, overrides: dict[str, Any], report: ErrorReport) -> dict:
    """``--set trainer.max_steps=5``-style overrides, applied to the raw mapping."""
    raw = _deep_copy(raw)
    for dotted, value in overrides.items():
        node = raw
        keys = dotted.split(".")
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                report.error(dotted, "cannot set a key below a non-mapping value")
                break
            node = child
        else:
            node[keys[-1]] = value
    return raw


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _structure_strategy_configs(
    workflow: Workflow, raw: dict, host: PluginHost, report: ErrorReport
) -> Workflow:
    """Structure each role's ``strategy_config`` with the class of the strategy it names."""
    try:
        strategies = host.strategies()
    except UserError as exc:
        report.error("plugins", str(exc))
        return workflow
    updates = {}
    for role_name in (*ROLE_NAMES, *SECTION_ROLES):
        role = getattr(workflow, role_name)
        if role is not None and role.strategy_args is not None:
            name, config = role.strategy_args.strategy_name, role.strategy_args.strategy_config
        else:
            # The role failed to structure (reported already); still check its strategy, so
            # every error shows at once. Its config is checked but has nowhere to go.
            block = raw.get(role_name)
            args = block.get("strategy_args") if isinstance(block, dict) else None
            if not isinstance(args, dict) or not isinstance(args.get("strategy_name"), str):
                continue
            name, config = args["strategy_name"], args.get("strategy_config")
        path = join_path(role_name, "strategy_args", "strategy_name")
        spec = strategies.get(name)
        if spec is None:
            hint = unknown_name_hint(name, strategies, "strategies", KNOWN_PROVIDERS)
            report.error(path, f"unknown strategy '{name}'", hint)
            continue
        config_path = join_path(role_name, "strategy_args", "strategy_config")
        config = structure_into(config or {}, spec.config_class, config_path, report)
        if config is not None and role is not None:
            updates[role_name] = attrs.evolve(
                role, strategy_args=attrs.evolve(role.strategy_args, strategy_config=config)
            )
    return attrs.evolve(workflow, **updates) if updates else workflow
