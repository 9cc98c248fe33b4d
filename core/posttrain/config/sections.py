"""The workflow's sections as attrs classes. Key names follow ROLL's where ROLL has them.

Every field's docstring-like comment feeds docs/config-reference.md (checked by a test).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

Dtype = Literal["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]


@attrs.frozen(kw_only=True)
class ModelArgs:
    """Model settings; top-level values are defaults that a role's own ``model_args`` override."""

    # HF directory, hub id, or a tiny preset built locally: "preset:tiny-qwen2-addition".
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None
    model_type: str | None = None
    dtype: Dtype = "fp32"
    attn_implementation: str | None = None
    disable_gradient_checkpointing: bool = True
    trust_remote_code: bool = False
    flash_attn: str | None = None  # ROLL key, accepted for compatibility


@attrs.frozen(kw_only=True)
class TrainingArgs:
    """Optimizer and batching settings of a training role (ROLL's ``training_args``)."""

    learning_rate: float = 1.0e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1.0e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    num_train_epochs: int = 1
    max_steps: int = -1
    # Dynamic micro-batches: pack sequences under a token budget instead of a fixed count.
    use_dynamic_batch_size: bool = False
    max_tokens_per_micro_batch: int = 4096


@attrs.frozen(kw_only=True)
class GeneratingArgs:
    """Sampling settings of the rollout role (ROLL's ``generating_args``)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    num_return_sequences: int | None = None  # defaults to algorithm.group_size
    stop_token_ids: list[int] = attrs.field(factory=list)
    # A sample also ends with the token that completes one of these strings; the reward sees the
    # text before the string (vLLM's `stop`).
    stop_strings: list[str] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class StrategyArgs:
    strategy_name: str
    # Raw mapping until the strategy is known; then the strategy's own config instance.
    strategy_config: Any = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class RoleConfig:
    """One role: its backend, its devices and its settings."""

    strategy_args: StrategyArgs
    device_mapping: tuple[int, ...] = (0,)
    model_args: ModelArgs = attrs.field(factory=ModelArgs)
    training_args: TrainingArgs | None = None
    generating_args: GeneratingArgs | None = None
    infer_batch_size: int | None = None
    world_size: int | None = None  # defaults to len(device_mapping)

    @property
    def num_ranks(self) -> int:
        return self.world_size or len(self.device_mapping)


@attrs.frozen(kw_only=True)
class SyntheticData:
    task: Literal["single_digit_addition"] = "single_digit_addition"
    max_sum: int = 9
    num_prompts: int | None = None  # default: every problem of the task once per epoch


@attrs.frozen(kw_only=True)
class DataConfig:
    """Prompts: a JSONL/Parquet file, or a synthetic task posttrain generates."""

    path: str | None = None
    synthetic: SyntheticData | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: Literal["auto", "always", "never"] = "auto"
    shuffle: bool = True
    seed: int = 42
    max_prompt_length: int = 512


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: GRPO (PPO needs a critic role)."""

    name: Literal["grpo", "ppo"] = "grpo"
    group_size: int = 8
    rollout_batch_size: int = 16  # prompts per step
    norm_adv_by_std: bool = True
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # DAPO clip-higher: separate low/high bounds
    clip_ratio_high: float | None = None
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    # Where the old-policy log-probs of the ratio come from. "rollout": the rollout engine's
    # log-probs of the sampled tokens (no extra forward pass); "recompute": a trainer forward
    # pass before the update. "auto" is "rollout" when the update is on-policy (one PPO epoch,
    # one mini-batch: the policy that sampled is the policy being updated), else "recompute".
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"

    def old_logprobs_source(self) -> str:
        if self.old_logprobs != "auto":
            return self.old_logprobs
        on_policy = self.ppo_epochs == 1 and self.num_mini_batches == 1
        return "rollout" if on_policy else "recompute"


@attrs.frozen(kw_only=True)
class RewardConfig:
    """Rule-based reward: ``exact_match``, ``numeric_match`` or ``module:function``."""

    function: str = "exact_match"
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    strategy_args: StrategyArgs | None = None
    device_mapping: tuple[int, ...] | None = None


@attrs.frozen(kw_only=True)
class TrainerConfig:
    max_steps: int = 100
    save_steps: int = 0  # 0: only at the end when save_final is set
    save_final: bool = True
    save_total_limit: int | None = None
    # Save in the background: the loop waits only while the state is copied to host memory
    # (strategies that cannot, e.g. deepspeed_train, save synchronously either way).
    async_save: bool = True
    output_dir: str = "runs/default"
    logger: list[Literal["console", "jsonl", "tensorboard"]] = attrs.field(
        factory=lambda: ["console", "jsonl"]
    )
    resume: str = "never"  # "never", "auto", or a checkpoint directory
    seed: int = 42
    weight_sync_bucket_mb: int = 256
    progress: bool = True


@attrs.frozen(kw_only=True)
class ClusterConfig:
    launcher: Literal["local", "ray"] = "local"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": roles with the same device_mapping share one set of rank processes (hybrid engine)
    # when their strategies can live beside others; "separate": one set of processes per role.
    colocation: Literal["auto", "separate"] = "auto"
    address: str | None = None
    num_cpus: int | None = None
    object_store_memory: int | None = None
    runtime_env: dict[str, Any] = attrs.field(factory=dict)
    start_timeout_s: float = 300.0
    call_timeout_s: float = 1800.0
    threads_per_worker: int | None = None


ROLE_NAMES = ("actor_train", "actor_infer", "reference", "critic")


@attrs.frozen(kw_only=True)
class Workflow:
    model_args: ModelArgs = attrs.field(factory=ModelArgs)
    data: DataConfig = attrs.field(factory=DataConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    actor_train: RoleConfig | None = None
    actor_infer: RoleConfig | None = None
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    reward: RewardConfig = attrs.field(factory=RewardConfig)
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)
    cluster: ClusterConfig = attrs.field(factory=ClusterConfig)
    plugins: list[str] = attrs.field(factory=list)
    # Directory of the workflow file: relative paths in it resolve against this.
    base_dir: str = "."

    def roles(self) -> dict[str, RoleConfig]:
        return {name: getattr(self, name) for name in ROLE_NAMES if getattr(self, name)}
