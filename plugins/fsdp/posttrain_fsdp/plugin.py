"""The ``fsdp2_train`` and ``fsdp2_infer`` strategies: HF models sharded with PyTorch FSDP2.

This module is cheap to import (no torch): ``posttrain validate`` and ``posttrain plugins`` load
it. The worker hooks (from :class:`posttrain.EngineHooks`) import
:mod:`posttrain_fsdp.engine` when a rank of one of these strategies first needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from posttrain import Capabilities, EngineHooks, ScoringOptions, StrategySpec, hookimpl
from posttrain.backend import (
    MemoryQuery,
    ReleaseKnob,
    RoleMemory,
    adam_trainer_state,
    dtype_bytes,
    forward_working_bytes,
    hf_trainer_phases,
    logit_bytes,
    release_knobs,
    routing_replay_problem,
)

if TYPE_CHECKING:
    from posttrain import ErrorReport, TrainEngine, Workflow
    from posttrain_fsdp import engine

    _ENGINE: TrainEngine = engine  # mypy: the engine defines every function it must, typed

TRAIN = "fsdp2_train"
INFER = "fsdp2_infer"
STRATEGIES = (TRAIN, INFER)

DtypeName = Literal["fp32", "bf16", "fp16"]


@attrs.frozen(kw_only=True)
class FSDP2TrainConfig(ScoringOptions):
    """``strategy_config`` of ``fsdp2_train``.

    Master weights and optimizer state are float32; ``param_dtype`` is the dtype of the gathered
    weights the forward/backward run in (mixed precision). Gradient checkpointing follows
    ``model_args.disable_gradient_checkpointing``; micro-batching follows ``training_args``
    (``use_dynamic_batch_size`` / ``max_tokens_per_micro_batch``) unless set here
    (``micro_batch_size``, ``logprob_micro_batch_size``: :class:`posttrain.ScoringOptions`).
    """

    # Compute dtype of the all-gathered parameters; None: the role's model_args.dtype.
    param_dtype: DtypeName | None = None
    # Dtype of the gradient reduce-scatter; None: same as param_dtype.
    reduce_dtype: DtypeName | None = None
    # Free the gathered parameters after forward (ZeRO-3); False keeps them for backward (ZeRO-2).
    reshard_after_forward: bool = True
    # Keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy).
    cpu_offload: bool = False
    # Move the weights and gradients (param_offload) and the optimizer state (optimizer_offload)
    # to host memory while another role on the same GPUs runs, as verl's knobs; off, they stay
    # on the device: faster, when memory allows; auto: on where the memory plan needs it.
    param_offload: ReleaseKnob = "auto"
    optimizer_offload: ReleaseKnob = "auto"


@attrs.frozen(kw_only=True)
class FSDP2InferConfig(ScoringOptions):
    """``strategy_config`` of ``fsdp2_infer`` (reference / old-policy log-probs). Rows per
    forward pass: ``logprob_micro_batch_size`` or ``micro_batch_size``, else the role's
    ``infer_batch_size``, else 8."""

    # Compute dtype of the all-gathered parameters; None: the role's model_args.dtype.
    param_dtype: DtypeName | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Move the weights to host memory while another role on the same GPUs runs; auto: where the
    # memory plan needs it.
    param_offload: ReleaseKnob = "auto"


class FSDPPlugin(EngineHooks):
    strategies = STRATEGIES
    engine = "posttrain_fsdp.engine"
    preload = (  # torch's FSDP2 and DCP modules: about 3 s of a CI core
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint.state_dict",
        "posttrain_fsdp.engine",
    )

    @hookimpl
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name=TRAIN,
                config_class=FSDP2TrainConfig,
                capabilities=Capabilities(
                    kind="train",
                    exports_hf_weights=True,
                    computes_logprobs=True,
                    shares_process=True,
                    heads=("lm", "value"),
                    lora=True,
                    routing_replay=True,
                ),
                description="training (actor or critic) with PyTorch FSDP2 and DCP checkpoints",
            ),
            StrategySpec(
                name=INFER,
                config_class=FSDP2InferConfig,
                capabilities=Capabilities(
                    kind="infer",
                    computes_logprobs=True,
                    shares_process=True,
                    heads=("lm", "score"),
                    routing_replay=True,
                ),
                description="log-probs (reference) or reward-model scores, FSDP2-sharded",
            ),
        ]

    @hookimpl
    def posttrain_validate_workflow(self, workflow: Workflow, report: ErrorReport) -> None:
        """``algorithm.routing_replay`` on for an fsdp2_train actor whose model has no experts
        (read from its config.json, without torch)."""
        actor = workflow.roles().get("actor_train")
        if actor is None or actor.strategy_args.strategy_name != TRAIN:
            return
        if "algorithm" in report.failed_sections:
            return
        problem = routing_replay_problem(workflow)
        if problem is not None:
            report.error(*problem)

    @hookimpl
    def posttrain_estimate_memory(self, query: MemoryQuery) -> RoleMemory | None:
        name = query.role.strategy_args.strategy_name
        if name == TRAIN:
            return estimate_train(query)
        if name == INFER:
            return estimate_infer(query)
        return None


def estimate_train(query: MemoryQuery) -> RoleMemory:
    """Float32 master weights and AdamW's state sharded over the role's GPUs (none on the GPU
    with ``cpu_offload``); while training, the float32 gradients (as sharded), two layers
    gathered in the compute dtype, and a micro-batch's activations and logits."""
    g, cfg = query.geometry, query.config
    compute = dtype_bytes(cfg.param_dtype or query.role.model_args.dtype)
    state = adam_trainer_state(g.params, query.gpus)
    # The gradients live only inside a train call: train_step ends with
    # optimizer.zero_grad(set_to_none=True), so between calls (while a colocated rollout runs)
    # the trainer holds weights and optimizer state only (measured:
    # tests/fsdp/test_fsdp_memory_plan.py).
    grads = state.pop("grads")
    resident = {} if cfg.cpu_offload else state
    gathered = 2 * g.layer_params * compute + g.vocab_size * g.hidden_size * compute
    train_tokens = query.train_micro_batch_tokens(cfg.micro_batch_size)
    score_tokens = query.train_micro_batch_tokens(cfg.scoring_rows())
    phases = hf_trainer_phases(
        query,
        dtype_bytes=compute,
        train_tokens=train_tokens,
        score_tokens=score_tokens,
        chunk_tokens=cfg.logprob_chunk_tokens,
        gathered=gathered,
        grads=0 if cfg.cpu_offload else grads,
    )
    path = f"{query.role_name}.strategy_args.strategy_config"
    released, auto = release_knobs(
        cfg, {"param_offload": ("weights", "grads"), "optimizer_offload": ("optimizer",)}
    )
    recompute = f"{query.role_name}.model_args.disable_gradient_checkpointing: false (recompute"
    knobs = (
        *(() if query.recompute else (f"{recompute} activations)",)),
        f"{query.role_name}.training_args.max_tokens_per_micro_batch (with "
        "use_dynamic_batch_size: true) or per_device_train_batch_size: fewer tokens a pass",
        f"{path}.optimizer_offload / param_offload: true (host memory while others run)",
        f"{path}.cpu_offload: true (weights and optimizer in host memory throughout)",
        "more GPUs in the role's device_mapping (its state is sharded over them)",
    )
    return RoleMemory(
        resident=resident, phases=phases, released=released, knobs=knobs, auto_release=auto
    )


def estimate_infer(query: MemoryQuery) -> RoleMemory:
    """The weights in the compute dtype sharded over the role's GPUs, two layers gathered, and
    one micro-batch's forward pass."""
    g, cfg = query.geometry, query.config
    compute = dtype_bytes(cfg.param_dtype or query.role.model_args.dtype)
    tokens = query.scoring_micro_batch_tokens(cfg.scoring_rows())
    weights = 0 if cfg.cpu_offload else g.params * compute // query.gpus
    phases = {
        "logprobs": {
            "forward": forward_working_bytes(g, tokens, compute),
            "logits": logit_bytes(g, tokens, cfg.logprob_chunk_tokens, compute, training=False),
            "gathered": 2 * g.layer_params * compute + g.vocab_size * g.hidden_size * compute,
        }
    }
    path = f"{query.role_name}.strategy_args.strategy_config"
    released, auto = release_knobs(cfg, {"param_offload": ("weights",)})
    return RoleMemory(
        resident={"weights": weights},
        phases=phases,
        released=released,
        auto_release=auto,
        knobs=(
            f"{path}.micro_batch_size or {query.role_name}.infer_batch_size: fewer rows a pass",
            f"{path}.param_offload: true (host memory while others run)",
        ),
    )


plugin = FSDPPlugin()
