"""Checks of the ``algorithm`` section against the registered pieces (before anything starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.algorithms.registry import (
    advantage_estimators,
    algorithm_presets,
    estimator_name,
    policy_loss_name,
    policy_losses,
)
from posttrain.config.report import ErrorReport, did_you_mean
from posttrain.config.sections import Workflow
from posttrain.errors import UserError
from posttrain.markers import hookimpl

if TYPE_CHECKING:
    import pluggy


def _unknown(report: ErrorReport, path: str, what: str, name: str, known: dict[str, Any]) -> None:
    close = did_you_mean(name, known)
    hint = f"{close} " if close.startswith("did you mean") else ""
    report.error(
        path, f"unknown {what} '{name}'", f"{hint}available: {', '.join(sorted(known)) or 'none'}"
    )


def check_algorithm(wf: Workflow, hook: pluggy.HookRelay, report: ErrorReport) -> None:
    algo = wf.algorithm
    try:
        presets, estimators, losses = (
            algorithm_presets(hook),
            advantage_estimators(hook),
            policy_losses(hook),
        )
    except UserError as exc:  # two plugins declare one name
        report.error("plugins", str(exc))
        return
    if algo.name not in presets:
        _unknown(report, "algorithm.name", "algorithm", algo.name, presets)
        return
    name = estimator_name(algo, hook)
    if name not in estimators:
        _unknown(report, "algorithm.advantage_estimator", "advantage estimator", name, estimators)
        return
    loss = policy_loss_name(algo, hook)
    if loss not in losses:
        _unknown(report, "algorithm.policy_loss", "policy loss", loss, losses)
    estimator = estimators[name]
    # A critic block that failed to structure was reported already; wf.critic is None then.
    critic_failed = "critic" in report.failed_sections
    if estimator.needs_values and wf.critic is None and not critic_failed:
        report.error(
            "critic",
            f"the advantage estimator '{name}' (algorithm '{algo.name}') needs values from a "
            "critic role",
            "add a critic: block (a trainer strategy, e.g. fsdp2_train, with training_args)",
        )
    if not estimator.needs_values and wf.critic is not None:
        report.error(
            "critic",
            f"the advantage estimator '{name}' does not use a critic's values",
            "remove the critic: block, or use algorithm.name: ppo (advantage_estimator: gae)",
        )
    if algo.group_size < estimator.min_group_size:
        report.error(
            "algorithm.group_size",
            f"'{name}' compares the samples of one prompt: group_size {algo.group_size} is too "
            f"small",
            f"use at least {estimator.min_group_size}",
        )
    if algo.dynamic_sampling and algo.group_size < 2:
        report.error(
            "algorithm.dynamic_sampling",
            "dynamic sampling drops groups whose rewards are all equal: with group_size "
            f"{algo.group_size} every group would be dropped",
            "use group_size >= 2",
        )
    if algo.tis_cap is not None and algo.old_logprobs == "rollout":
        report.error(
            "algorithm.tis_cap",
            "rollout correction compares the trainer's old log-probs with the rollout's, but "
            "old_logprobs: rollout uses the rollout's as the trainer's",
            "set old_logprobs: auto (or recompute)",
        )
    if wf.critic is None and algo.critic_warmup and not critic_failed:
        report.error(
            "algorithm.critic_warmup",
            f"{algo.critic_warmup} warm-up steps, but there is no critic role",
            "remove it, or add a critic",
        )


@hookimpl(trylast=True)
def posttrain_validate_workflow(
    workflow: Workflow, report: ErrorReport, hook: pluggy.HookRelay
) -> None:
    if "algorithm" not in report.failed_sections:
        check_algorithm(workflow, hook, report)
