"""Core's cross-field workflow checks and environment checks (a plugin like any other)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from posttrain.config.data_sections import check_prompt_source
from posttrain.config.report import ErrorReport, did_you_mean, join_path
from posttrain.config.sections import PRODUCER_ROLES, ROLE_HEADS, Workflow
from posttrain.host.doctor import EnvCheck
from posttrain.launch.base import partial_overlaps
from posttrain.loading.hub_models import check_hub_ids, looks_local
from posttrain.loading.lora_sync import check_lora_sync
from posttrain.markers import hookimpl
from posttrain.paths import display_path
from posttrain.rollout.partial import segment_tokens
from posttrain.tasks.presets import PRESETS, is_preset
from posttrain.training.lr_schedule import run_optimizer_steps

if TYPE_CHECKING:
    from posttrain.host.strategy import StrategySpec

# Roles every workflow has (the critic and reference depend on the algorithm's settings).
REQUIRED_ROLES = ("actor_train", "actor_infer")


@hookimpl(trylast=True)
def posttrain_environment_checks() -> list[EnvCheck]:
    return [
        EnvCheck(plugin="posttrain", package="torch", tested=">=2.6,<=2.13.0"),
        EnvCheck(plugin="posttrain", package="transformers", tested=">=4.51,<6"),
        EnvCheck(plugin="posttrain", package="pluggy", tested=">=1.5,<2"),
        EnvCheck(plugin="posttrain", package="cattrs", tested=">=23.2"),
    ]


@hookimpl(trylast=True)
def posttrain_validate_workflow(
    workflow: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport
) -> None:
    # A section that failed to structure was reported already; checks that read it would only
    # add misleading errors about its defaults (e.g. "needs an 'actor_train' role").
    failed = report.failed_sections
    if not failed & {"algorithm", *REQUIRED_ROLES, "reference"}:
        _check_roles(workflow, report)
    _check_strategy_kinds(workflow, strategies, report)
    _check_models(workflow, report)
    if not failed & {"actor_train", "actor_infer"}:
        check_lora_sync(workflow, strategies, report)
    if "data" not in failed:
        _check_data(workflow, report)
    if "algorithm" not in failed:
        _check_batches(workflow, strategies, report)
    if "trainer" not in failed:
        _check_trainer(workflow, report)
    if not failed & {"trainer", "algorithm"}:
        _check_schedules(workflow, report)
    if not failed & {"algorithm", "actor_infer", "cluster"}:
        _check_async_rollout(workflow, report)
    if not failed & {"algorithm", "actor_infer", "environment"}:
        _check_partial_rollout(workflow, report)
        _check_routing_replay(workflow, strategies, report)
    if "cluster" not in failed:
        _check_cluster(workflow, report)


# What each role asks of its strategy: the kinds that can fill it.
ROLE_KINDS = {
    "actor_train": ("train",),
    "actor_infer": ("rollout",),
    # A scoring role runs frozen: a trainer there would build an optimizer it never steps (and
    # asks for training_args), so it takes a forward-only or rollout strategy.
    "reference": ("infer", "rollout"),
    "critic": ("train",),
    "reward": ("infer", "rollout"),
}


def _check_strategy_kinds(
    wf: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport
) -> None:
    for name, role in wf.roles().items():
        spec = strategies.get(role.strategy_args.strategy_name)
        if spec is None:
            continue  # unknown strategy: already reported
        kinds = ROLE_KINDS[name]
        if spec.capabilities.kind not in kinds:
            report.error(
                join_path(name, "strategy_args", "strategy_name"),
                f"'{spec.name}' is a {spec.capabilities.kind} strategy; {name} needs "
                f"one of kind {' or '.join(kinds)}",
                _fitting_strategies(spec, kinds, strategies),
            )
        elif name == "reference" and not spec.capabilities.computes_logprobs:
            report.error(
                join_path(name, "strategy_args", "strategy_name"),
                f"'{spec.name}' does not compute log-probs, which reference needs",
            )
        elif name == "actor_train" and role.model_args.lora and not spec.capabilities.lora:
            able = sorted(s for s, sp in strategies.items() if sp.capabilities.lora)
            report.error(
                join_path(name, "model_args", "lora"),
                f"'{spec.name}' does not train LoRA adapters",
                f"strategies that do: {', '.join(able) or 'none installed'}; "
                "or remove model_args.lora",
            )
        elif ROLE_HEADS.get(name, "lm") not in spec.capabilities.heads:
            head = ROLE_HEADS[name]
            able = sorted(
                s
                for s, sp in strategies.items()
                if head in sp.capabilities.heads and sp.capabilities.kind in kinds
            )
            report.error(
                join_path(name, "strategy_args", "strategy_name"),
                f"'{spec.name}' cannot load a {head} head, which {name} needs",
                f"strategies that can: {', '.join(able) or 'none installed'}",
            )


def _fitting_strategies(
    spec: StrategySpec, kinds: tuple[str, ...], strategies: dict[str, StrategySpec]
) -> str:
    """The installed strategies of ``kinds``, those of ``spec``'s own plugin first (a trainer's
    forward-only sibling shards the model the same way)."""
    fitting = sorted(
        (sp.plugin != spec.plugin, s)
        for s, sp in strategies.items()
        if sp.capabilities.kind in kinds
    )
    names = [s for _, s in fitting]
    if not names:
        return "installed: none"
    if spec.capabilities.kind == "train" and not fitting[0][0]:
        return (
            f"a scoring role runs frozen, with no optimizer: use {names[0]}; "
            f"installed: {', '.join(names)}"
        )
    return f"installed: {', '.join(names)}"


def _check_roles(wf: Workflow, report: ErrorReport) -> None:
    for role in REQUIRED_ROLES:
        if getattr(wf, role) is None:
            report.error(
                role,
                f"algorithm '{wf.algorithm.name}' needs the '{role}' role",
                f"add a {role}: block with strategy_args and device_mapping",
            )
    if wf.algorithm.kl_coef and wf.reference is None:
        report.error(
            "reference",
            "algorithm.kl_coef > 0 needs a 'reference' role",
            "add a reference: block, or set algorithm.kl_coef: 0",
        )
    train = wf.actor_train
    if train is not None and train.training_args is None:
        report.note("actor_train.training_args", "not set; defaults are used")


def _check_models(wf: Workflow, report: ErrorReport) -> None:
    for name, role in wf.roles().items():
        path = role.model_args.model_name_or_path
        where = join_path(name, "model_args", "model_name_or_path")
        if not path:
            report.error(
                where,
                "no model given",
                "set model_args.model_name_or_path at the top or in this role",
            )
            continue
        if is_preset(path):
            key = path.split(":", 1)[1]
            if key not in PRESETS:
                report.error(where, f"unknown preset '{key}'", did_you_mean(key, PRESETS))
            continue
        local = path if os.path.isabs(path) else os.path.join(wf.base_dir, path)
        if os.path.exists(local):
            if not os.path.exists(os.path.join(local, "config.json")):
                report.error(
                    where,
                    f"{display_path(local)} has no config.json",
                    "point to an HF model directory (the one holding config.json)",
                )
        elif looks_local(path):
            report.error(where, f"local model path {display_path(local)} does not exist")
        else:
            report.note(
                where,
                f"'{path}' is not a local directory: treated as a hub id; "
                "checks that need its config were skipped",
            )
    check_hub_ids(wf, report)


def _check_schedules(wf: Workflow, report: ErrorReport) -> None:
    """A learning-rate schedule given its own length that is not the run's: a warning, since a
    longer one may be meant (the first steps of a longer run), but it no longer follows
    trainer.max_steps."""
    run = run_optimizer_steps(wf)
    for name, role in wf.roles().items():
        args = role.training_args
        if args is None or args.max_steps in (-1, run):
            continue
        if args.lr_scheduler_type == "constant" and not args.warmup_ratio:
            continue  # the length changes nothing
        algo = wf.algorithm
        report.warn(
            join_path(name, "training_args", "max_steps"),
            f"{args.max_steps}: the {args.lr_scheduler_type} learning-rate schedule ends at "
            f"optimizer step {args.max_steps}, the run at {run} (trainer.max_steps "
            f"{wf.trainer.max_steps} x {algo.ppo_epochs * algo.num_mini_batches} updates a step: "
            "algorithm.ppo_epochs x num_mini_batches)",
            "leave it unset to follow trainer.max_steps",
        )


def _check_data(wf: Workflow, report: ErrorReport) -> None:
    check_prompt_source(wf.data, wf.base_dir, "data", report)


def _check_batches(wf: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport) -> None:
    algo = wf.algorithm
    samples = algo.rollout_batch_size * algo.group_size
    for name, role in wf.roles().items():
        dp = _dp_size(wf, name, strategies, report)
        if dp is None:
            continue
        if name == "actor_infer":
            if algo.rollout_batch_size < dp:
                # Shares may differ by one prompt, but none may be empty.
                report.error(
                    "algorithm.rollout_batch_size",
                    f"{algo.rollout_batch_size} prompts leave some of actor_infer's {dp} "
                    "data-parallel ranks without a prompt",
                    f"use at least {dp}",
                )
            gen = role.generating_args
            if gen and gen.num_return_sequences not in (None, algo.group_size):
                report.error(
                    "actor_infer.generating_args.num_return_sequences",
                    f"must equal algorithm.group_size ({algo.group_size})",
                    "remove it; group_size sets it",
                )
            spec = strategies.get(role.strategy_args.strategy_name)
            if gen and gen.stop_strings and spec and not spec.capabilities.stop_strings:
                report.error(
                    "actor_infer.generating_args.stop_strings",
                    f"'{spec.name}' does not support stop strings",
                    "use stop_token_ids, or a rollout strategy that supports them",
                )
            if gen and "" in gen.stop_strings:
                report.error(
                    "actor_infer.generating_args.stop_strings",
                    "an empty string would stop every sample after its first token",
                    "remove it",
                )
        elif name == "reward":
            if samples % dp:
                report.error(
                    "algorithm.rollout_batch_size",
                    f"{samples} samples per step (rollout_batch_size x group_size) do not "
                    f"split over the reward model's {dp} data-parallel ranks",
                    f"make rollout_batch_size x group_size a multiple of {dp}",
                )
        elif samples % (dp * algo.num_mini_batches):
            report.error(
                "algorithm.rollout_batch_size",
                f"{samples} samples per step (rollout_batch_size x group_size) do not "
                f"split into {algo.num_mini_batches} mini-batch(es) over {name}'s "
                f"{dp} data-parallel ranks",
                f"make rollout_batch_size x group_size a multiple of {dp * algo.num_mini_batches}",
            )


def _dp_size(
    wf: Workflow, role_name: str, strategies: dict[str, StrategySpec], report: ErrorReport
) -> int | None:
    """Ranks / product of the strategy's declared parallel sizes, or None with an error."""
    role = wf.roles()[role_name]
    config = role.strategy_args.strategy_config
    if isinstance(config, dict):  # strategy unknown or config invalid: already reported
        return None
    spec = strategies.get(role.strategy_args.strategy_name)
    dims = spec.capabilities.parallel_dims if spec else ()
    sizes = {d: int(getattr(config, d, 1) or 1) for d in dims}
    product = math.prod(sizes.values())
    if role.num_ranks % product:
        detail = " x ".join(f"{d}={s}" for d, s in sizes.items())
        report.error(
            join_path(role_name, "device_mapping"),
            f"{role.num_ranks} device(s) do not divide by the parallel sizes "
            f"({detail} = {product})",
            f"map a multiple of {product} devices or lower the parallel sizes",
        )
        return None
    return role.num_ranks // product


def _check_trainer(wf: Workflow, report: ErrorReport) -> None:
    t = wf.trainer
    if t.resume not in ("never", "auto"):
        path = t.resume if os.path.isabs(t.resume) else os.path.join(wf.base_dir, t.resume)
        if not os.path.isdir(path):
            report.error(
                "trainer.resume",
                f"checkpoint directory not found: {display_path(path)}",
                "use 'auto', 'never' or an existing checkpoint-N directory",
            )
    if not wf.reward.function and wf.reward.strategy_args is None and not wf.environment.name:
        report.error(
            "reward",
            "no reward: reward.function is null and there is no reward model or environment",
            "set reward.function (e.g. exact_match), or reward.strategy_args and model_args",
        )


# Roles the asynchronous producer uses (the rest run on the loop's thread meanwhile).


def _check_async_rollout(wf: Workflow, report: ErrorReport) -> None:
    """Rollout that runs while the trainer learns needs devices and processes of its own."""
    if not wf.algorithm.max_staleness:
        return
    if wf.algorithm.tis_cap is None and wf.algorithm.old_logprobs_source() == "recompute":
        report.error(
            "algorithm.tis_cap",
            f"algorithm.max_staleness is {wf.algorithm.max_staleness} and the old log-probs are "
            "recomputed by the trainer, but tis_cap is null: the loss would ignore that an "
            "older policy sampled the batch",
            "set algorithm.tis_cap (e.g. 2.0): each token's loss is then weighted by "
            "min(p_trainer / p_rollout, tis_cap); or, with one update per batch, "
            "old_logprobs: auto (the PPO ratio then measures against the policy that sampled)",
        )
    roles = wf.roles()
    producer = {d for name in PRODUCER_ROLES if name in roles for d in roles[name].device_mapping}
    for name, role in roles.items():
        shared = sorted(producer & set(role.device_mapping))
        if name in PRODUCER_ROLES or not shared:
            continue
        report.error(
            "actor_infer.device_mapping",
            f"algorithm.max_staleness is {wf.algorithm.max_staleness}, but actor_infer (or the "
            f"reward model) shares devices {shared} with {name}: rollout and training cannot "
            "run at once on them",
            "map actor_infer to devices of its own (a disaggregated layout), or set "
            "algorithm.max_staleness: 0",
        )
        return


def _check_routing_replay(
    wf: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport
) -> None:
    """Routing replay needs a trainer that replays and, for ``rollout``, an engine that
    returns the routing of every token, which segmented and multi-turn samples do not carry."""
    mode = wf.algorithm.routing_replay
    if mode == "off":
        return
    roles = wf.roles()
    needed = ("actor_train", "actor_infer") if mode == "rollout" else ("actor_train",)
    for name in needed:
        role = roles.get(name)
        spec = strategies.get(role.strategy_args.strategy_name) if role is not None else None
        if spec is not None and not spec.capabilities.routing_replay:
            does = "replays routing" if name == "actor_train" else "returns each token's routing"
            report.error(
                "algorithm.routing_replay",
                f"{mode!r} with {name}'s strategy '{spec.name}', which does not say it {does}",
                "set algorithm.routing_replay: off, or a strategy that supports it "
                "(`posttrain plugins` lists them)",
            )
    if mode != "rollout":
        return
    for key, on in (
        ("algorithm.partial_rollout: true", wf.algorithm.partial_rollout),
        (f"environment.name {wf.environment.name!r}", bool(wf.environment.name)),
    ):
        if on:
            report.error(
                "algorithm.routing_replay",
                f"'rollout' with {key}: segmented and multi-turn samples do not carry their "
                "routing yet",
                "set algorithm.routing_replay: old_policy (replays the old-policy pass's "
                "routing) or off",
            )


def _check_partial_rollout(wf: Workflow, report: ErrorReport) -> None:
    """Segments are released to weight syncs between them: asynchronous, single-turn rollout,
    where a generation can span more than one segment."""
    algo = wf.algorithm
    if not algo.partial_rollout:
        return
    if not algo.max_staleness:
        report.error(
            "algorithm.partial_rollout",
            "true with algorithm.max_staleness 0: a synchronous loop syncs weights only between "
            "two steps' rollouts, so no generation is ever interrupted",
            "set algorithm.max_staleness: 1 (asynchronous rollout, actor_infer on devices of "
            "its own), or partial_rollout: false",
        )
    if wf.environment.name:
        report.error(
            "algorithm.partial_rollout",
            f"true with environment.name {wf.environment.name!r}: partial rollouts segment "
            "single-turn generations; multi-turn episodes are not segmented",
            "set algorithm.partial_rollout: false, or leave environment.name null",
        )
    # actor_infer may be missing (reported by _check_roles).
    gen = wf.actor_infer.generating_args if wf.actor_infer is not None else None
    if gen is not None and gen.stop_strings:
        report.error(
            "actor_infer.generating_args.stop_strings",
            f"{list(gen.stop_strings)} with algorithm.partial_rollout: an engine looks for stop "
            "strings in the text of its own call, so one split across two segments would be "
            "missed",
            "end samples with stop_token_ids instead, or set algorithm.partial_rollout: false",
        )
    max_new_tokens = gen.max_new_tokens if gen is not None else 32
    segment = segment_tokens(algo, gen)
    if segment >= max_new_tokens:
        # (no segment is below a max_new_tokens of 1)
        lower = f"set it below {max_new_tokens} (null: a quarter of max_new_tokens), "
        report.error(
            "algorithm.partial_rollout_segment_tokens",
            f"{segment} is not below actor_infer.generating_args.max_new_tokens "
            f"({max_new_tokens}): every generation fits one segment and is never interrupted",
            f"{lower if max_new_tokens > 1 else ''}raise max_new_tokens, or set "
            "partial_rollout: false",
        )


def _check_cluster(wf: Workflow, report: ErrorReport) -> None:
    c = wf.cluster
    for name in ("hang_report_s", "collective_timeout_s"):
        value = getattr(c, name)
        if value is not None and value >= c.call_timeout_s:
            report.error(
                f"cluster.{name}",
                f"{value:g} is not below cluster.call_timeout_s ({c.call_timeout_s:g}): it would "
                "never come before the run gives up on the call",
                f"set it below {c.call_timeout_s:g}, or leave it null (automatic)",
            )
    if c.launcher != "ray":
        if c.devices_per_node is not None:
            report.error(
                "cluster.devices_per_node",
                f"{c.devices_per_node} with cluster.launcher: {c.launcher}: only the ray "
                "launcher places ranks on several nodes; the local launcher runs every rank on "
                "this machine",
                "set cluster.launcher: ray (docs/multi-node.md), or leave devices_per_node out",
            )
        return  # the local launcher runs any mapping
    for _, b, message in partial_overlaps(wf.roles()):
        report.error(
            join_path(b, "device_mapping"),
            message,
            "map both roles to the same devices, or one to a subset of the other's, "
            "or to devices of their own",
        )
