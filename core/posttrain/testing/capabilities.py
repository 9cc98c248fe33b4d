"""Declared capabilities against implemented hooks: the conformance kit's consistency check.

The kit picks its tests by a strategy's :class:`~posttrain.Capabilities`, and the core
picks the hooks it calls by them. A declaration that disagrees with the engine therefore fails
silently: an engine that generates but is declared ``kind="infer"`` is never asked to generate,
and the kit skips its generation and weight-import tests. :func:`check_capabilities` names every
such disagreement and its fix.

What a strategy implements is read without running it where possible: an
:class:`~posttrain.EngineHooks` plugin answers a hook for its strategies exactly when
its engine module defines the function of the hook's name (read from the source). A hook written
by hand can only tell by being called: for the read-only hooks (``generate``,
``compute_logprobs``) the check calls it on a started rank; the others stay unjudged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.host.engine_hooks import EngineHooks
from posttrain.host.engine_source import engine_names
from posttrain.host.strategy import Capabilities, StrategySpec

if TYPE_CHECKING:
    from posttrain.host.plugin_host import PluginHost
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.worker import WorkerRuntime


@attrs.frozen
class HookUse:
    """When the core calls the worker hook ``posttrain_<function>`` (the engine function
    ``<function>``) of a strategy."""

    function: str
    called: Callable[[Capabilities], bool]
    declaration: str  # the strategies ``called`` is true for, for messages
    fields: tuple[str, ...] = ()  # the Capabilities fields ``called`` reads
    required: bool = True  # a strategy for which it is called must implement it
    # How to declare it, for a strategy that implements it though it is never called ("": the
    # hook may be implemented for strategies that are never asked, e.g. a rollout checkpoint).
    fix_unused: str = ""


def _kind(kind: str) -> Callable[[Capabilities], bool]:
    return lambda c: c.kind == kind


def _always(_capabilities: Capabilities) -> bool:
    return True


_ROLLOUT = "declare kind='rollout'"
_TRAIN = "declare kind='train'"
_ROLLOUTS = "a kind='rollout' strategy"
_TRAINERS = "a kind='train' strategy"

USES = (
    HookUse("setup_parallel", _always, "every strategy"),
    HookUse("load_model", _always, "every strategy"),
    # Devices shared with another role's phase, and the run's end: without them a colocated
    # run keeps this role's memory through the other's phase, and its process group open.
    HookUse("release_memory", _always, "every strategy"),
    HookUse("resume_memory", _always, "every strategy"),
    HookUse("shutdown_worker", _always, "every strategy"),
    HookUse("generate", _kind("rollout"), _ROLLOUTS, ("kind",), fix_unused=_ROLLOUT),
    HookUse("import_weights", _kind("rollout"), _ROLLOUTS, ("kind",), fix_unused=_ROLLOUT),
    HookUse(
        "weight_receiver",
        _kind("rollout"),
        _ROLLOUTS,
        ("kind",),
        required=False,
        fix_unused=_ROLLOUT,
    ),
    HookUse("train_step", _kind("train"), _TRAINERS, ("kind",), fix_unused=_TRAIN),
    HookUse("export_weights", _kind("train"), _TRAINERS, ("kind",), fix_unused=_TRAIN),
    HookUse("save_checkpoint", _kind("train"), _TRAINERS, ("kind",)),
    HookUse("load_checkpoint", _kind("train"), _TRAINERS, ("kind",)),
    HookUse("export_hf", _kind("train"), _TRAINERS, ("kind",)),
    HookUse(
        "compute_logprobs",
        lambda c: c.computes_logprobs,
        "a strategy with computes_logprobs=True",
        ("computes_logprobs",),
        fix_unused="set computes_logprobs=True",
    ),
    HookUse(
        "compute_values",
        lambda c: c.kind == "train" and "value" in c.heads,
        "a kind='train' strategy with 'value' in heads (a critic)",
        ("kind", "heads"),
        fix_unused="for a critic, declare kind='train' with 'value' in heads",
    ),
    HookUse(
        "compute_scores",
        lambda c: c.kind != "train" and "score" in c.heads,
        "a kind='infer' or 'rollout' strategy with 'score' in heads (a reward model)",
        ("kind", "heads"),
        fix_unused="for a reward model, declare kind='infer' or 'rollout' with 'score' in heads",
    ),
)

# Hooks that change nothing on the rank: a hand-written one may be called to see if it answers.
PROBED = ("generate", "compute_logprobs")


@attrs.define
class Implemented:
    """Which functions of :data:`USES` answer for a strategy (None: cannot tell), and the
    strategies whose declarations account for them (those one engine module serves)."""

    answers: dict[str, bool | None]
    sharing: tuple[StrategySpec, ...]


def implemented(host: PluginHost, strategy: str) -> Implemented:
    """What answers for ``strategy`` in ``host``, without calling any hook."""
    specs = host.strategies()
    owners = [
        p for p in host.pm.get_plugins() if isinstance(p, EngineHooks) and strategy in p.strategies
    ]
    answers = {use.function: _answer(host, use.function, strategy) for use in USES}
    sharing = {strategy} | {s for p in owners for s in p.strategies}
    return Implemented(answers, tuple(specs[s] for s in sorted(sharing) if s in specs))


def _answer(host: PluginHost, function: str, strategy: str) -> bool | None:
    hook = f"posttrain_{function}"
    found: list[bool | None] = []
    for impl in getattr(host.hook, hook).get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue  # passes another implementation's answer on
        plugin = impl.plugin
        if isinstance(plugin, EngineHooks) and getattr(type(plugin), hook) is getattr(
            EngineHooks, hook
        ):
            if strategy in plugin.strategies:
                names = engine_names(plugin.engine)
                found.append(None if names is None else function in names)
        else:
            found.append(None)  # written by hand: only a call can tell
    if True in found:
        return True
    return None if None in found else False


def answers_on_rank(runtime: WorkerRuntime, calls: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Rank side (``group.call("run_function", ...)``): whether each hook in ``calls``
    (function name -> keyword arguments) answers for this rank's strategy."""
    worker = runtime.ctx
    return {
        function: getattr(worker.hook, f"posttrain_{function}")(worker=worker, **kwargs) is not None
        for function, kwargs in calls.items()
    }


def _probe_calls(functions: Iterable[str]) -> dict[str, dict[str, Any]]:
    from posttrain.protocol import GenerationRequest, SamplingParams, build_sequence_batch
    from posttrain.testing.batches import PROMPTS

    prompt = PROMPTS[0]
    arguments: dict[str, dict[str, Any]] = {
        "generate": {
            "request": GenerationRequest(
                prompt_ids=[prompt], sampling=SamplingParams(n=1, max_new_tokens=1), seed=0
            )
        },
        "compute_logprobs": {"batch": build_sequence_batch([prompt], [[4]], 0)},
    }
    return {f: arguments[f] for f in functions}


def mismatches(spec: StrategySpec, found: Implemented) -> list[str]:
    """Each disagreement between ``spec``'s capabilities and the functions ``found``, with the
    fix. A function no answer is known for (None) is not judged."""
    declared = spec.capabilities
    problems = []
    for use in USES:
        answer = found.answers.get(use.function)
        what = ", ".join(f"{f}={getattr(declared, f)!r}" for f in use.fields)
        if answer is False and use.required and use.called(declared):
            fix = (
                f"; it declares {what}: implement it, or change that" if what else ": implement it"
            )
            problems.append(
                f"{spec.name} implements no {use.function} (engine function {use.function}, "
                f"hook posttrain_{use.function}), which the core calls for {use.declaration}{fix}"
            )
        elif answer and use.fix_unused and not _called_for(use, declared, found.sharing):
            others = [s.name for s in found.sharing if s.name != spec.name]
            also = f", nor {' or '.join(others)} (sharing its engine module)" if others else ""
            problems.append(
                f"{spec.name} implements {use.function} but declares {what}; the core calls it "
                f"only for {use.declaration}, which {spec.name} is not{also}: it is never called "
                f"and the conformance kit does not test it; {use.fix_unused}, or remove "
                f"{use.function}"
            )
    return problems


def _called_for(use: HookUse, declared: Capabilities, sharing: Iterable[StrategySpec]) -> bool:
    # One engine module serving several strategies holds the functions of them all (fsdp2_infer
    # beside fsdp2_train's train_step): one that some of them declares is accounted for.
    return use.called(declared) or any(use.called(s.capabilities) for s in sharing)


def check_capabilities(
    spec: StrategySpec, host: PluginHost, start: Callable[[], WorkerGroup] | None = None
) -> list[str]:
    """:func:`mismatches` of ``spec`` in ``host``. ``start()`` gives a started group of the
    strategy, for hand-written hooks that only a call can judge (None: leave them unjudged)."""
    found = implemented(host, spec.name)
    unknown = [
        use.function
        for use in USES
        if use.function in PROBED
        and found.answers[use.function] is None
        and use.fix_unused
        and not use.called(spec.capabilities)
    ]
    if unknown and start is not None:
        ranks = start().call("run_function", f"{__name__}:answers_on_rank", _probe_calls(unknown))
        found.answers.update({f: any(rank[f] for rank in ranks) for f in unknown})
    return mismatches(spec, found)
