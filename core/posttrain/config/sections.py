"""The workflow's sections as attrs classes. Key names follow ROLL's where ROLL has them.

Every field's docstring-like comment feeds docs/config-reference.md (checked by a test).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from posttrain.config.data_sections import DataConfig, EvaluationConfig
from posttrain.config.ranges import at_least, between, greater_than

Dtype = Literal["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]


def _not_empty(instance: Any, attribute: attrs.Attribute, value: list) -> None:
    if not value:
        raise ValueError(
            f"{attribute.name} is empty; name the modules that get an adapter, "
            "e.g. q_proj and v_proj"
        )


@attrs.frozen(kw_only=True)
class LoraArgs:
    """Low-rank adapters (LoRA, through peft) on the trained policy: only the adapters train,
    the base weights stay frozen. The strategy must support it (``posttrain plugins`` lists
    those that do: fsdp2_train, deepspeed_train and megatron_train in this repository)."""

    # Rank r of each adapter pair (B @ A).
    rank: int = attrs.field(default=8, validator=at_least(1))
    # Scale of the update: W + (alpha / rank) * B @ A.
    alpha: float = attrs.field(default=16.0, validator=greater_than(0))
    # Dropout on the adapters' input while training.
    dropout: float = attrs.field(default=0.0, validator=between(0, 1, high_open=True))
    # Names (last component) of the linear modules that get an adapter.
    target_modules: list[str] = attrs.field(
        factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        validator=_not_empty,
    )
    # What a weight sync sends the rollout engine: "adapter", only the adapters (a few MB; the
    # engine keeps its base weights and adds the low-rank product); "merged", the whole model
    # with W + (alpha / rank) * B @ A; "auto", adapter where actor_infer's strategy takes
    # adapters (`posttrain plugins` lists them), merged elsewhere. `posttrain run` resolves
    # "auto" before any process starts.
    sync: Literal["auto", "adapter", "merged"] = "auto"


@attrs.frozen(kw_only=True)
class ModelArgs:
    """Model settings; top-level values are defaults that a role's own ``model_args`` override."""

    # HF directory, hub id, or a tiny preset built locally: "preset:tiny-qwen2" (the presets are
    # in posttrain/tasks/presets.py).
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None
    model_type: str | None = None
    dtype: Dtype = "fp32"
    attn_implementation: str | None = None
    # Activation checkpointing off (true) or on (false), as ROLL's key; "auto": on where the
    # memory plan (`posttrain plan`) says a GPU would otherwise fill, off elsewhere. `posttrain
    # run` resolves it before any process starts: strategies only ever see true or false.
    disable_gradient_checkpointing: Literal[True, False, "auto"] = "auto"
    trust_remote_code: bool = False
    flash_attn: str | None = None  # ROLL key, accepted for compatibility
    # Train low-rank adapters instead of every weight; null: full fine-tuning.
    lora: LoraArgs | None = None
    # Vision-language models: the vision tower (and its merger) is not trained (true, the
    # common default) or trained with the rest (false). Text models: no effect.
    freeze_vision: bool = True


@attrs.frozen(kw_only=True)
class TrainingArgs:
    """Optimizer and batching settings of a training role (ROLL's ``training_args``).

    The optimizer settings' ranges are AdamW's own.
    """

    learning_rate: float = attrs.field(default=1.0e-6, validator=at_least(0))
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    adam_beta1: float = attrs.field(default=0.9, validator=between(0, 1, high_open=True))
    adam_beta2: float = attrs.field(default=0.999, validator=between(0, 1, high_open=True))
    adam_epsilon: float = attrs.field(default=1.0e-8, validator=at_least(0))
    max_grad_norm: float = attrs.field(default=1.0, validator=at_least(0))  # 0: no clipping
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = attrs.field(default=0, validator=at_least(0))
    warmup_ratio: float = attrs.field(default=0.0, validator=between(0, 1))
    per_device_train_batch_size: int = attrs.field(default=1, validator=at_least(1))
    gradient_accumulation_steps: int = attrs.field(default=1, validator=at_least(1))
    num_train_epochs: int = attrs.field(default=1, validator=at_least(1))
    # Length of the LR schedule in optimizer steps (decay ends here). Unset: the run's own,
    # trainer.max_steps x algorithm.ppo_epochs x num_mini_batches, so it follows
    # --set trainer.max_steps.
    max_steps: int = attrs.field(
        default=-1, validator=at_least(1, also={-1: "unset: the run's optimizer steps"})
    )
    # Dynamic micro-batches: rows of similar length under a token budget instead of a fixed
    # count; the budget counts padded tokens (rows x the micro-batch's longest row).
    use_dynamic_batch_size: bool = False
    max_tokens_per_micro_batch: int = attrs.field(default=4096, validator=at_least(1))


@attrs.frozen(kw_only=True)
class GeneratingArgs:
    """Sampling settings of the rollout role (ROLL's ``generating_args``)."""

    max_new_tokens: int = attrs.field(default=32, validator=at_least(1))
    temperature: float = attrs.field(default=1.0, validator=at_least(0))  # 0: greedy
    top_p: float = attrs.field(default=1.0, validator=between(0, 1, low_open=True))
    top_k: int = attrs.field(default=-1, validator=at_least(1, also={-1: "off", 0: "off"}))
    # defaults to algorithm.group_size
    num_return_sequences: int | None = attrs.field(default=None, validator=at_least(1))
    stop_token_ids: list[int] = attrs.field(factory=list)
    # A sample also ends with the token that completes one of these strings; the reward sees the
    # text before the string (vLLM's `stop`).
    stop_strings: list[str] = attrs.field(factory=list)
    # Keep sampling past the end-of-sequence token, to max_new_tokens (vLLM's `ignore_eos`):
    # forced lengths for benchmarks; stop_token_ids and stop_strings still end a sample.
    ignore_eos: bool = False


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
    infer_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    # defaults to len(device_mapping)
    world_size: int | None = attrs.field(default=None, validator=at_least(1))

    @property
    def num_ranks(self) -> int:
        return self.world_size or len(self.device_mapping)


def _off_if_false(value: str | bool) -> str | bool:
    """``off``, however YAML spelled it (a bare ``off`` is the boolean false in YAML 1.1)."""
    return "off" if value is False else value


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: a preset and its pieces (advantage estimator, policy loss)."""

    # Preset: grpo, ppo (GAE with a critic role), reinforce_plus_plus, rloo, gspo, or one a
    # plugin declares (posttrain_add_algorithms).
    name: str = "grpo"
    # Advantage estimator (grpo, rloo, reinforce_plus_plus, gae, or a plugin's); null: the
    # preset's.
    advantage_estimator: str | None = None
    # Per-token policy loss (ppo, gspo, or a plugin's); null: the preset's.
    policy_loss: str | None = None
    group_size: int = attrs.field(default=8, validator=at_least(1))
    rollout_batch_size: int = attrs.field(default=16, validator=at_least(1))  # prompts per step
    norm_adv_by_std: bool = True
    clip_ratio: float = attrs.field(default=0.2, validator=greater_than(0))
    # DAPO clip-higher: separate low/high bounds
    clip_ratio_low: float | None = attrs.field(default=None, validator=greater_than(0))
    clip_ratio_high: float | None = attrs.field(default=None, validator=greater_than(0))
    # Dual-clip: a negative advantage's loss is capped at -advantage * clip_ratio_c; null: off.
    clip_ratio_c: float | None = attrs.field(default=3.0, validator=greater_than(1))
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = attrs.field(default=0.0, validator=at_least(0))
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    entropy_coef: float = attrs.field(default=0.0, validator=at_least(0))
    ppo_epochs: int = attrs.field(default=1, validator=at_least(1))
    num_mini_batches: int = attrs.field(default=1, validator=at_least(1))
    # Where the old-policy log-probs of the ratio come from. "rollout": the rollout engine's
    # log-probs of the sampled tokens (no extra forward pass); "recompute": a trainer forward
    # pass before the update. "auto" is "rollout" when each batch makes one update (one PPO
    # epoch, one mini-batch), else "recompute". (With tis_cap set, "auto" recomputes: the
    # correction compares both.) With asynchronous rollout, "rollout" makes the PPO ratio and
    # its clip measure the update against the older policy that sampled.
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"
    # Discount and GAE lambda of token-level estimators (gae, reinforce_plus_plus).
    gamma: float = attrs.field(default=1.0, validator=between(0, 1))
    lam: float = attrs.field(default=1.0, validator=between(0, 1))
    # Whiten GAE advantages over the batch (REINFORCE++ always whitens).
    whiten_advantages: bool = True
    # Critic: how far a new value may move from the old one in the value loss; null: no clip.
    cliprange_value: float | None = attrs.field(default=0.5, validator=greater_than(0))
    # Steps at the start during which only the critic learns (the policy and rollout stay).
    critic_warmup: int = attrs.field(default=0, validator=at_least(0))
    # DAPO dynamic sampling: drop groups whose rewards are all equal (no signal) and sample
    # more prompts until rollout_batch_size groups are kept, at most max_sampling_rounds
    # rollouts per step (then the batch is filled with dropped groups, and that is logged).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = attrs.field(default=4, validator=at_least(1))
    # Rollout correction: truncated importance sampling. Each token's loss is weighted by
    # min(p_trainer / p_rollout, tis_cap) of the sampled token, for rollouts from another
    # engine or dtype than the trainer's; null: off.
    tis_cap: float | None = attrs.field(default=None, validator=greater_than(0))
    # Asynchronous rollout: the batch of the next step is generated while the trainer learns
    # from this one, by the policy this many updates behind the trainer's (fewer in the first
    # steps), whatever the timing: a rerun or a resume is the same run (0: the synchronous
    # loop; 1: one-step off-policy). Needs actor_infer on devices of its own. With
    # one update per batch the ratio's old policy is the one that sampled (old_logprobs: auto);
    # with more, the trainer's recomputed log-probs, and tis_cap corrects for the older policy.
    max_staleness: int = attrs.field(default=0, validator=at_least(0))
    # Partial rollout (asynchronous rollout only): generate in segments of at most
    # partial_rollout_segment_tokens new tokens, the engine released between two, so a weight
    # sync waits for one segment instead of the batch's longest sample, and samples still
    # running go on with the new weights. Each token keeps the version that sampled it and its
    # behaviour log-prob, which the ratio (old_logprobs: rollout) and tis_cap use.
    partial_rollout: bool = False
    # null: a quarter of actor_infer.generating_args.max_new_tokens.
    partial_rollout_segment_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    # Routing replay for mixture-of-experts models (R3, arXiv 2510.11370): the experts each
    # token was routed to are replayed in the trainer's forward passes, so trainer and rollout
    # score with the same experts. "rollout": the rollout engine's routing (the old-policy,
    # reference and update passes); "old_policy": the trainer's own old-policy pass's (the
    # update only); off: every pass routes by itself. The router still learns through the
    # replayed experts' gate probabilities. (YAML reads a bare off as false: both mean off.)
    routing_replay: Literal["off", "rollout", "old_policy", False] = attrs.field(
        default="off", converter=_off_if_false
    )

    def old_logprobs_source(self) -> str:
        if self.old_logprobs != "auto":
            return self.old_logprobs
        one_update = self.ppo_epochs == 1 and self.num_mini_batches == 1
        return "rollout" if one_update and self.tis_cap is None else "recompute"


@attrs.frozen(kw_only=True)
class RewardConfig:
    """Rewards: a rule-based function, a reward model, or both combined by weight."""

    # Rule-based function: exact_match, numeric_match, a name a plugin declares, or
    # "module:function" (called as fn(response, answer, prompt, **kwargs)); null: none.
    function: str | None = "exact_match"
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    # The reward is function_weight * function + model_weight * model score.
    function_weight: float = attrs.field(default=1.0, validator=at_least(0))
    model_weight: float = attrs.field(default=1.0, validator=at_least(0))
    # Run the function in this many worker processes, each call with timeout_s (slow
    # verifiers); 0: in the driver, no timeout. A call that raises or times out scores 0.
    num_workers: int = attrs.field(default=0, validator=at_least(0))
    timeout_s: float = attrs.field(default=10.0, validator=greater_than(0))
    # A reward model (a sequence-classification model with one label): its own backend,
    # devices and model; scored as the "reward" role. Leave strategy_args out for none.
    strategy_args: StrategyArgs | None = None
    device_mapping: tuple[int, ...] = (0,)
    model_args: ModelArgs = attrs.field(factory=ModelArgs)
    infer_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    world_size: int | None = attrs.field(default=None, validator=at_least(1))

    def role(self) -> RoleConfig | None:
        """The reward model as a role, or None without one."""
        if self.strategy_args is None:
            return None
        return RoleConfig(
            strategy_args=self.strategy_args,
            device_mapping=self.device_mapping,
            model_args=self.model_args,
            infer_batch_size=self.infer_batch_size,
            world_size=self.world_size,
        )


@attrs.frozen(kw_only=True)
class EnvironmentConfig:
    """Multi-turn episodes: the model acts over several turns in an environment (tools, games).

    The environment's rewards take the place of reward.function's score (reward.function then
    scores the final answers a tool environment hands over); a reward model still adds its own.
    """

    # An environment a plugin declares (posttrain_add_environments), e.g. calculator; null:
    # single-turn rollouts.
    name: str | None = None
    # The environment's own settings, checked against its config class once it is known.
    kwargs: Any = attrs.field(factory=dict)
    # Model turns per episode; the last one is still scored.
    max_turns: int = attrs.field(default=4, validator=at_least(1))
    # Tokens of the whole response, the model's and the environment's; an episode that reaches
    # it ends there (env/truncated). Each turn is also capped by generating_args.max_new_tokens.
    max_total_tokens: int = attrs.field(default=512, validator=at_least(1))
    # Longest an environment call may take; an episode whose call overruns, raises or answers
    # garbage scores 0 (env/timeouts, env/errors) and the run goes on.
    step_timeout_s: float = attrs.field(default=10.0, validator=greater_than(0))
    # Where environment instances run. thread: in the driver's threads (a call that overruns is
    # abandoned, not stopped; right for environments that bound their own work, as both
    # built-ins do). process: in worker processes the driver kills and replaces when a call
    # overruns or the process dies (plugin environments that may hang, crash or leak).
    isolation: Literal["thread", "process"] = "thread"
    # Worker processes of isolation: process; each serves its episodes' calls one at a time.
    processes: int = attrs.field(default=4, validator=at_least(1))
    # Steps in a row whose every episode failed before the run stops with an error (each such
    # step is warned about; with dynamic sampling each round counts as a step).
    max_failed_steps: int = attrs.field(default=3, validator=at_least(1))
    # episode: one reward per episode, the sum of its turns'; turn: token-level advantage
    # estimators (reinforce_plus_plus, gae) also see each turn's reward on the turn's last token.
    reward: Literal["episode", "turn"] = "episode"


@attrs.frozen(kw_only=True)
class TrainerConfig:
    max_steps: int = attrs.field(default=100, validator=at_least(1))
    save_steps: int = attrs.field(
        default=0, validator=at_least(1, also={0: "only at the end, when save_final is set"})
    )
    save_final: bool = True
    # Checkpoints kept (the oldest go first); null keeps every one.
    save_total_limit: int | None = attrs.field(default=None, validator=at_least(1))
    # Save in the background: the loop waits only while the state is copied to host memory
    # (strategies that cannot, e.g. deepspeed_train, save synchronously either way).
    async_save: bool = True
    output_dir: str = "runs/default"
    # Loggers plugins declare (posttrain_add_loggers): console, jsonl and tensorboard are built
    # in; wandb and mlflow come with posttrain-trackers.
    logger: list[str] = attrs.field(factory=lambda: ["console", "jsonl"])
    # Each logger's own options, by its name, e.g. {wandb: {project: my-project}}; checked
    # against the logger's config class (docs/trackers.md).
    logger_args: dict[str, Any] = attrs.field(factory=dict)
    resume: str = "never"  # "never", "auto", or a checkpoint directory
    # A resume whose workflow defines another run than the checkpoint's (algorithm, data, model,
    # roles and their devices, rewards, environment, seed) is refused unless this is set.
    allow_resume_changes: bool = False
    # resume: auto, and the latest checkpoint is damaged (a file missing or corrupted): resume
    # from the latest one that is whole instead, saying so (false: stop, naming the file).
    resume_fallback: bool = False
    seed: int = 42
    weight_sync_bucket_mb: int = attrs.field(default=256, validator=at_least(1))
    # Which weight-sync buckets the rollout side checks against the byte sums the trainer sent:
    # every bucket of every sync; first: all of the first sync and one bucket of each later one;
    # off: none. A difference stops the run, naming the tensors (docs/reliability.md).
    weight_sync_verify: Literal["every", "first", "off"] = "first"
    progress: bool = True


@attrs.frozen(kw_only=True)
class ClusterConfig:
    # "local": one process per rank on this machine; "ray": one Ray actor per rank, placed from
    # device_mapping (docs/ray.md).
    launcher: Literal["local", "ray"] = "local"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": roles with the same device_mapping share one set of rank processes (hybrid engine)
    # when their strategies can live beside others; "separate": one set of processes per role.
    colocation: Literal["auto", "separate"] = "auto"
    # Ray only. null: start a Ray instance for the run and stop it at the end; "auto" or
    # "HOST:PORT": join a running cluster and leave it up. num_cpus and object_store_memory size
    # the instance posttrain starts.
    address: str | None = None
    num_cpus: int | None = attrs.field(default=None, validator=at_least(1))
    object_store_memory: int | None = attrs.field(default=None, validator=at_least(1))  # bytes
    runtime_env: dict[str, Any] = attrs.field(factory=dict)
    # Ray only: device_mapping counts devices across nodes, this many a node (ROLL's
    # num_gpus_per_node, NeMo-RL's cluster.gpus_per_node): device d runs on the (d // N)-th node,
    # the head first, then by IP (docs/multi-node.md). null: Ray packs each role's bundles.
    devices_per_node: int | None = attrs.field(default=None, validator=at_least(1))
    start_timeout_s: float = attrs.field(default=300.0, validator=greater_than(0))
    # A call to a role that runs longer fails the run (docs/hangs.md: how the timeouts relate).
    call_timeout_s: float = attrs.field(default=1800.0, validator=greater_than(0))
    # A call that runs this long gets every process's Python stacks written under
    # RUN_DIR/hangs/step-N/ and a summary printed; the run goes on waiting. null: automatic, 10
    # times the call's median duration (at least 60 s; 600 s until two are known), at most half
    # of call_timeout_s.
    hang_report_s: float | None = attrs.field(default=None, validator=greater_than(0))
    # The process groups' timeout (NCCL, gloo, the weight-sync group and its store): a collective
    # that waits this long raises on its rank, naming the collective. Below call_timeout_s, so a
    # stuck collective fails on the ranks first. null: half of call_timeout_s.
    collective_timeout_s: float | None = attrs.field(default=None, validator=greater_than(0))
    threads_per_worker: int | None = attrs.field(default=None, validator=at_least(1))
    # GiB of each GPU the run may use; null: the whole card. The memory plan checks the workflow
    # against it, and every rank's allocator is capped to it: for a GPU shared with other work,
    # or to rehearse a smaller card on a larger one (79.6 for an H100 80GB).
    gpu_memory_gib: float | None = attrs.field(default=None, validator=greater_than(0))

    def collective_timeout(self) -> float:
        return self.collective_timeout_s or self.call_timeout_s / 2


ROLE_NAMES = ("actor_train", "actor_infer", "reference", "critic")
# Roles that come from another section (the reward model is configured under ``reward``).
SECTION_ROLES = ("reward",)
# The model head each role loads (WorkerContext.head); others load a causal LM.
ROLE_HEADS = {"critic": "value", "reward": "score"}
# The roles that produce a step's samples (rollout and reward), the rest run the loop's phases.
PRODUCER_ROLES = ("actor_infer", "reward")


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
    environment: EnvironmentConfig = attrs.field(factory=EnvironmentConfig)
    evaluation: EvaluationConfig = attrs.field(factory=EvaluationConfig)
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)
    cluster: ClusterConfig = attrs.field(factory=ClusterConfig)
    plugins: list[str] = attrs.field(factory=list)
    # Directory of the workflow file: relative paths in it resolve against this.
    base_dir: str = "."

    def roles(self) -> dict[str, RoleConfig]:
        roles = {name: getattr(self, name) for name in ROLE_NAMES if getattr(self, name)}
        reward_model = self.reward.role()
        if reward_model is not None:
            roles["reward"] = reward_model
        return roles
