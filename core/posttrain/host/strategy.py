"""What a plugin declares about each strategy it provides (no engine imports here)."""

from __future__ import annotations

import difflib

import attrs

from posttrain.config.scoring_options import ScoringOptions
from posttrain.errors import PluginError

KINDS = ("train", "infer", "rollout")


def _check_kind(_instance: object, _attribute: attrs.Attribute[str], value: object) -> None:
    # A misspelt kind would make every role refuse the strategy with a puzzling message, and the
    # conformance kit skip the tests of the kind meant: refuse it where it is written.
    if value not in KINDS:
        close = difflib.get_close_matches(str(value), KINDS, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise PluginError(
            f"Capabilities.kind must be 'train', 'infer' or 'rollout', not {value!r}{hint}"
        )


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a strategy can do; the core validates workflows against it, and the conformance kit
    (:mod:`posttrain.testing`) picks its tests by it and checks it against the hooks the
    strategy implements.

    ``kind`` says which worker hooks the core calls for the strategy, and so which roles it can
    fill (``posttrain validate`` refuses the others):

    ``"train"``
        A trainer: ``actor_train`` and ``critic`` (with ``"value"`` in ``heads``); never a
        scoring role (``reference``, ``reward``), which runs frozen. The core calls
        ``setup_parallel``, ``load_model``, ``train_step``,
        ``compute_logprobs`` (old-policy and reference log-probs), ``export_weights`` (the
        source of every weight sync), the checkpoint hooks (``save_checkpoint`` or
        ``begin_checkpoint``/``finish_checkpoint``, ``load_checkpoint``: checkpoints hold the
        trained roles), ``export_hf`` (``posttrain export-hf``), ``compute_values`` (a critic),
        ``release_memory``/``resume_memory`` (devices shared with another role) and
        ``shutdown_worker``.
    ``"rollout"``
        A generation engine: ``actor_infer``, ``reference`` and ``reward`` (with ``"score"`` in
        ``heads``). The core calls ``setup_parallel``, ``load_model``, ``generate``,
        ``import_weights`` (the target of every weight sync; ``weight_receiver`` for an engine
        that receives ``broadcast`` buckets itself), ``compute_logprobs`` (reference),
        ``compute_scores`` (reward), ``release_memory``/``resume_memory`` and
        ``shutdown_worker``. It is not checkpointed: a resumed run syncs the trainer's weights
        into it.
    ``"infer"``
        A forward-only model that keeps the weights it loaded (no generation, no weight
        import): ``reference`` and ``reward`` (with ``"score"`` in ``heads``). The core calls
        ``setup_parallel``, ``load_model``, ``compute_logprobs`` (reference),
        ``compute_scores`` (reward), ``release_memory``/``resume_memory`` and
        ``shutdown_worker``.

    So an engine that generates is a ``"rollout"`` strategy even when it is "for inference":
    declared ``"infer"``, it is never asked to generate. Any other value is a
    :class:`~posttrain.errors.PluginError` when the ``Capabilities`` is made.

    ``parallel_dims`` names the ``strategy_config`` fields whose product with the data-parallel
    size must equal the role's device count (e.g. ``("tensor_model_parallel_size",)``).
    """

    kind: str = attrs.field(validator=_check_kind)  # "train", "infer" or "rollout"
    parallel_dims: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    colocation: bool = True
    # Can live in one process beside other roles' strategies (hybrid engine): its worker state
    # stays in ``worker.state`` / ``worker.model`` and it tolerates a default process group that
    # another role of the same ranks already made. Off by default: a strategy that owns
    # process-wide state must say it is safe.
    shares_process: bool = False
    import_transports: tuple[str, ...] = ()  # for rollout: transports it can import through
    exports_hf_weights: bool = False  # for trainers: can feed weight sync
    # Answers posttrain_compute_logprobs; a reference role needs it.
    computes_logprobs: bool = True
    # Model heads it can load (``WorkerContext.head``): "lm" (causal LM), "value" (a critic's
    # per-token value head; a trainer with it trains critics), "score" (a reward model's
    # sequence score head).
    heads: tuple[str, ...] = ("lm",)
    # For rollout: honours SamplingParams.stop (generating_args.stop_strings). Strategies that do
    # not would silently ignore them, so validation refuses stop strings for them.
    stop_strings: bool = False
    # For trainers: trains LoRA adapters (model_args.lora) on an "lm" head, checkpoints only
    # them, syncs merged weights or, with ``model_args.lora.sync: adapter``, the adapters alone
    # (posttrain.backend.adapter_sync), and takes ``merge`` in posttrain_export_hf. Validation
    # refuses model_args.lora on an actor_train whose strategy does not.
    lora: bool = False
    # For rollout: takes adapter-only weight syncs (model_args.lora.sync: adapter): keeps its
    # base weights and applies the synced LoRA adapters (posttrain.backend.synced_adapter says
    # which) in every decode path.
    lora_adapter_sync: bool = False
    # Mixture-of-experts routing replay (algorithm.routing_replay): a rollout strategy returns
    # each sample's routing when asked (GenerationRequest.return_routing); a trainer replays a
    # batch's routing in its passes (posttrain.backend's scoring_forward / update_forward).
    # Validation refuses routing_replay where actor_train's or actor_infer's strategy does not.
    routing_replay: bool = False


# The options core's helpers read from a strategy_config, by the base that declares them.
SHARED_OPTIONS = {field.name: ScoringOptions for field in attrs.fields(ScoringOptions)}


def _check_config_class(_instance: object, _attribute: attrs.Attribute[type], value: type) -> None:
    # Core's helpers (score_rows, plan_micro_batches, logprob_forward) read these options only
    # through their declaring base; a config that declares one on its own would have it ignored
    # in silence: refuse it where it is declared, not inside a worker.
    if not attrs.has(value):
        raise PluginError(
            f"config_class must be an attrs class (@attrs.frozen(kw_only=True)), not {value!r}"
        )
    own = [
        (field.name, base)
        for field in attrs.fields(value)
        if (base := SHARED_OPTIONS.get(field.name)) is not None and not issubclass(value, base)
    ]
    if own:
        names = ", ".join(name for name, _ in own)
        base_name = own[0][1].__name__
        raise PluginError(
            f"{value.__name__} declares {names}, which core reads only from "
            f"posttrain.{base_name}: make it `class {value.__name__}(posttrain.{base_name})` "
            "(and drop its own declaration unless it changes the default)"
        )


@attrs.frozen(kw_only=True)
class StrategySpec:
    """A strategy as registered through ``posttrain_add_strategies``.

    ``config_class`` is an attrs class (``frozen=True, kw_only=True``) structured from the role's
    ``strategy_config`` only once this strategy is chosen. The options core's helpers read
    (rows per forward pass, log-prob chunking) come from :class:`posttrain.ScoringOptions`: a
    config that declares one of them without inheriting that base is a
    :class:`~posttrain.errors.PluginError` when the spec is made (core would never read it).
    """

    name: str
    config_class: type = attrs.field(validator=_check_config_class)
    capabilities: Capabilities
    description: str = ""
    # Filled in by the plugin host: the plugin (distribution or module) that declared it.
    plugin: str = ""


# This project's own strategies, by the package that provides them: used for install hints.
KNOWN_PROVIDERS: dict[str, str] = {
    "hf_infer": "posttrain-hf-infer (pip install ./plugins/hf_infer)",
    "fsdp2_train": "posttrain-fsdp (pip install ./plugins/fsdp)",
    "fsdp2_infer": "posttrain-fsdp (pip install ./plugins/fsdp)",
    "megatron_train": "posttrain-megatron (pip install ./plugins/megatron)",
    "megatron_infer": "posttrain-megatron (pip install ./plugins/megatron)",
    "vllm": "posttrain-vllm (pip install './plugins/vllm[cpu]' or './plugins/vllm[cuda]')",
    "sglang": "posttrain-sglang (pip install ./plugins/sglang, plus SGLang: .ci/sglang_env.sh)",
}
