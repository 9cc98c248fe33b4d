"""What a plugin declares about each strategy it provides (no engine imports here)."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a strategy can do; the core validates workflows against it.

    ``parallel_dims`` names the ``strategy_config`` fields whose product with the data-parallel
    size must equal the role's device count (e.g. ``("tensor_model_parallel_size",)``).
    """

    kind: str  # "train", "infer" or "rollout"
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
    computes_logprobs: bool = True
    # Model heads it can load (``WorkerContext.head``): "lm" (causal LM), "value" (a critic's
    # per-token value head; a trainer with it trains critics), "score" (a reward model's
    # sequence score head).
    heads: tuple[str, ...] = ("lm",)
    # For rollout: honours SamplingParams.stop (generating_args.stop_strings). Strategies that do
    # not would silently ignore them, so validation refuses stop strings for them.
    stop_strings: bool = False


@attrs.frozen(kw_only=True)
class StrategySpec:
    """A strategy as registered through ``posttrain_add_strategies``.

    ``config_class`` is an attrs class (``frozen=True, kw_only=True``) structured from the role's
    ``strategy_config`` only once this strategy is chosen.
    """

    name: str
    config_class: type
    capabilities: Capabilities
    description: str = ""
    # Filled in by the plugin host: the plugin (distribution or module) that declared it.
    plugin: str = ""


# This project's own strategies, by the package that provides them: used for install hints.
KNOWN_PROVIDERS: dict[str, str] = {
    "hf_infer": "posttrain",
    "fsdp2_train": "posttrain-fsdp (pip install ./plugins/fsdp)",
    "fsdp2_infer": "posttrain-fsdp (pip install ./plugins/fsdp)",
    "megatron_train": "posttrain-megatron (pip install ./plugins/megatron)",
    "megatron_infer": "posttrain-megatron (pip install ./plugins/megatron)",
    "vllm": "posttrain-vllm (pip install './plugins/vllm[cpu]' or './plugins/vllm[cuda]')",
    "sglang": "posttrain-sglang (pip install ./plugins/sglang, plus SGLang: .ci/sglang_env.sh)",
}
