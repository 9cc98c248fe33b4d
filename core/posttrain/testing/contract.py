"""Contract tests for one strategy, run on its real engine through the local launcher.

Which tests apply follows the strategy's declared capabilities, and a first test checks them
against the hooks the strategy implements (:mod:`posttrain.testing.capabilities`): rollout
engines generate and import weights; trainers train, export weights and checkpoint; every
strategy that computes log-probs must agree with a plain transformers forward pass on the same
weights; trainers that load a value head (``Capabilities.heads``) pass the critic contract too
(values, checkpoints and value-loss training of a ``critic`` role).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file

from posttrain.backends.lora import parse_adapter_wire_name
from posttrain.backends.models import HEAD_WEIGHT
from posttrain.backends.plumbing import MEMORY_TAGS
from posttrain.config.sections import (
    ROLE_HEADS,
    AlgorithmConfig,
    GeneratingArgs,
    LoraArgs,
    ModelArgs,
    RoleConfig,
    StrategyArgs,
    TrainingArgs,
)
from posttrain.launch.base import GroupSpec
from posttrain.launch.local import LocalLauncher
from posttrain.protocol import (
    GenerationRequest,
    RolloutSamples,
    SamplingParams,
    bucketize,
    concat_tensor_rows,
)
from posttrain.testing.batches import PROMPTS
from posttrain.testing.capabilities import check_capabilities
from posttrain.testing.expected import (
    export_state,
    group_values,
    kit_host,
    masked_value_loss,
    max_sample_logprob_diff,
    perturbed_state,
    reference_logprobs,
    reference_values,
    rng_fingerprint,
    samples_batch,
    state_difference,
    structure_config,
    synthetic_train_batch,
    value_probe,
    value_train_batch,
)
from posttrain.weight_sync.transport import InProcessTransport, SharedMemoryTransport

if TYPE_CHECKING:
    import pathlib

    from posttrain.host.strategy import StrategySpec
    from posttrain.launch.base import WorkerGroup

    # The structured strategy_config beside its spec (the ``spec_and_config`` fixture).
    SpecAndConfig = tuple[StrategySpec, Any]
    # The ``critic`` fixture: the group, and its export and values right after loading.
    Critic = tuple[WorkerGroup, dict[str, Any]]

# The resume contract's training: warmup then linear decay (the rate moves every step, so a
# schedule that restarts after a load shows), and clipping far below the gradients' norm (it
# acts on every step, as it does early in real runs).
RESUME_TRAINING = TrainingArgs(
    learning_rate=1e-2,
    max_grad_norm=1e-3,
    lr_scheduler_type="linear",
    warmup_steps=2,
    max_steps=8,
)


class StrategyContract:
    """Subclass with ``strategy = "name"``; optionally ``strategy_config``, ``world_size``, and
    ``plugins``: modules to load as a workflow's ``plugins:`` list would (a strategy whose
    package is not installed; its folder must be on ``PYTHONPATH`` for the rank processes)."""

    strategy: ClassVar[str] = ""
    strategy_config: ClassVar[dict[str, Any]] = {}
    world_size: ClassVar[int] = 1
    logprob_tolerance: ClassVar[float] = 1e-5
    supports_checkpoint: ClassVar[bool | None] = None  # None: trainers yes, others no
    group_timeout_s: ClassVar[float] = 240.0
    device: ClassVar[str] = "cpu"  # "cuda" runs the same contract on GPUs (NCCL)
    # The strategy_config the critic contract runs (None: strategy_config): a suite with one
    # class per layout can spend its critic runs on other layouts than its policy runs.
    critic_strategy_config: ClassVar[dict[str, Any] | None] = None
    # A trainer with the ``lora`` capability runs the contract again with adapters: export and
    # sync send merged weights (``lora.sync: merged``) or the adapters alone (``adapter``, to
    # hf_infer, which applies them), checkpoints hold the adapters.
    lora: ClassVar[LoraArgs | None] = None
    plugins: ClassVar[tuple[str, ...]] = ()

    # -- helpers ---------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def spec_and_config(cls) -> SpecAndConfig:
        return structure_config(cls.strategy, dict(cls.strategy_config), cls.plugins)

    @pytest.fixture
    def start(
        self, spec_and_config: SpecAndConfig, tiny_model_path: str, tmp_path: pathlib.Path
    ) -> Iterator[Callable[..., Any]]:
        """``start(strategy=None, config=None, world_size=None)`` -> a started worker group;
        ``start(..., beside=("hf_infer", "actor_infer"))`` -> the group and a group of that
        strategy and role hosted by the same rank processes (the hybrid engine);
        ``training_args`` replaces the kit's default (a constant rate, clipping at 1.0)."""

        launcher = LocalLauncher(
            call_timeout_s=self.group_timeout_s, start_timeout_s=self.group_timeout_s
        )
        model, tmp = tiny_model_path, str(tmp_path)

        def start(
            strategy: str | None = None,
            config: Any = None,
            world_size: int | None = None,
            role: str = "actor_train",
            beside: tuple[str, str] | None = None,
            training_args: TrainingArgs | None = None,
        ) -> WorkerGroup | tuple[WorkerGroup, WorkerGroup]:
            if beside is not None:
                spec = spec_for(strategy, config, world_size, role, training_args)
                other = spec_for(beside[0], None, spec.config.num_ranks, beside[1], None)
                groups = launcher.start_processes([spec, other])
                return groups[role], groups[beside[1]]
            return launcher.start_group(spec_for(strategy, config, world_size, role, training_args))

        def spec_for(
            strategy: str | None,
            config: Any,
            world_size: int | None,
            role: str,
            training_args: TrainingArgs | None,
        ) -> GroupSpec:
            if strategy is None:
                strategy, config = self.strategy, spec_and_config[1]
            elif config is None:
                config = structure_config(strategy, {}, self.plugins)[1]
            ranks = world_size or self.world_size
            return self.group_spec(
                strategy, config, ranks, role, model, tmp, training_args=training_args
            )

        yield start
        launcher.shutdown()

    @classmethod
    def group_spec(
        cls,
        strategy: str,
        config: Any,
        ranks: int,
        role: str,
        model_path: str,
        tmp: str,
        learning_rate: float = 1e-2,
        training_args: TrainingArgs | None = None,
    ) -> GroupSpec:
        """The GroupSpec of ``role`` (its model head as the core gives it) on ``ranks`` ranks;
        ``training_args`` default to a constant ``learning_rate``, clipping at 1.0."""

        role_config = RoleConfig(
            strategy_args=StrategyArgs(strategy_name=strategy, strategy_config=config),
            device_mapping=tuple(range(ranks)),
            model_args=ModelArgs(model_name_or_path=model_path, lora=cls.lora),
            training_args=training_args
            or TrainingArgs(learning_rate=learning_rate, max_grad_norm=1.0),
            generating_args=GeneratingArgs(),
        )
        return GroupSpec(
            role=role,
            config=role_config,
            algorithm=AlgorithmConfig(),
            seed=1234,
            run_dir=os.path.join(tmp, "run"),
            base_dir=tmp,
            device=cls.device,
            threads=1,
            head=ROLE_HEADS.get(role, "lm"),
            plugins=cls.plugins,
        )

    @pytest.fixture(scope="class")
    @classmethod
    def critic(
        cls,
        spec_and_config: SpecAndConfig,
        tiny_model_path: str,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[Critic]:
        """``(group, initial)``: one ``critic`` group of the strategy for the critic contract
        (started once per class: each test holds whatever state the previous ones left) and
        what it held right after loading: its export and its values of :func:`value_probe`."""
        spec, config = spec_and_config
        if "value" not in spec.capabilities.heads:
            pytest.skip(f"{cls.strategy} loads no value head (Capabilities.heads)")
        if cls.critic_strategy_config is not None:
            config = structure_config(cls.strategy, dict(cls.critic_strategy_config), cls.plugins)[
                1
            ]

        launcher = LocalLauncher(
            call_timeout_s=cls.group_timeout_s, start_timeout_s=cls.group_timeout_s
        )
        tmp = str(tmp_path_factory.mktemp("critic"))
        # A smaller step than the policy tests': a value regression at 1e-2 overshoots.
        group = launcher.start_group(
            cls.group_spec(
                cls.strategy, config, cls.world_size, "critic", tiny_model_path, tmp, 1e-3
            )
        )
        try:
            yield (
                group,
                {
                    "export": export_state(group),
                    "values": group_values(group, value_probe()),
                },
            )
        finally:
            launcher.shutdown()

    def kind(self, spec_and_config: SpecAndConfig) -> str:
        return spec_and_config[0].capabilities.kind

    def require(self, spec_and_config: SpecAndConfig, *kinds: str) -> None:
        if self.kind(spec_and_config) not in kinds:
            pytest.skip(f"{self.strategy} is a {self.kind(spec_and_config)} strategy")

    # -- every strategy --------------------------------------------------------------------

    def test_declared_capabilities_match_implemented_hooks(
        self, spec_and_config: SpecAndConfig, request: pytest.FixtureRequest
    ) -> None:
        """The capabilities the kit and the core go by agree with the hooks the strategy
        implements; otherwise the tests of what it does are skipped (an engine that generates,
        declared ``kind="infer"``) or fail far from the cause."""

        problems = check_capabilities(
            spec_and_config[0],
            kit_host(self.plugins),
            lambda: request.getfixturevalue("start")(),
        )
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)

    def test_setup_reports_data_parallel_coordinates(self, start: Callable[..., Any]) -> None:
        group = start()
        assert len(group.parallel) == self.world_size
        assert self.world_size % group.dp_size == 0
        assert {p["dp_rank"] for p in group.parallel} == set(range(group.dp_size))
        assert all(p["dp_size"] == group.dp_size for p in group.parallel)

    def test_logprobs_match_transformers_forward(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any], tiny_model_path: str
    ) -> None:
        if not spec_and_config[0].capabilities.computes_logprobs:
            pytest.skip("strategy does not compute log-probs")
        group = start()
        batch = synthetic_train_batch()
        shares = group.call_dp("compute_logprobs", batch.split(group.dp_size))

        got = concat_tensor_rows(shares) * batch.attention_mask
        ref = reference_logprobs(tiny_model_path, None, batch)
        self._close(float((got - ref).abs().max()), "compute_logprobs against transformers")

    # -- rollout engines -------------------------------------------------------------------

    def _generate(
        self, group: WorkerGroup, n: int = 3, max_new_tokens: int = 6, seed: int = 5
    ) -> RolloutSamples:

        sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens)
        shares = [
            GenerationRequest(
                prompt_ids=PROMPTS[(2 * i) % 4 : (2 * i) % 4 + 2], sampling=sampling, seed=seed + i
            )
            for i in range(group.dp_size)
        ]
        return RolloutSamples.concat(group.call_dp("generate", shares))

    def _close(self, gap: float, what: str) -> None:
        if not gap <= self.logprob_tolerance:
            pytest.fail(
                f"{what}: largest difference {gap:.3g}, tolerance {self.logprob_tolerance:g}",
                pytrace=False,
            )

    def test_generate_logprobs_match_transformers_forward(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any], tiny_model_path: str
    ) -> None:
        self.require(spec_and_config, "rollout")
        group = start()
        out = self._generate(group)
        assert len(out) == 2 * group.dp_size * 3
        assert all(1 <= len(r) <= 6 for r in out.response_ids)
        assert all(len(r) == len(lp) for r, lp in zip(out.response_ids, out.response_logprobs))
        ref = reference_logprobs(tiny_model_path, None, samples_batch(out))
        self._close(max_sample_logprob_diff(out, ref), "generate's log-probs against transformers")

    def test_import_weights_then_logprobs_match(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any], tiny_model_path: str
    ) -> None:
        self.require(spec_and_config, "rollout")

        group = start()
        # A generation first, as in a run: whatever the engine keeps from it (captured CUDA
        # graphs, a prefix cache) must see the imported weights, not the ones it was built on.
        self._generate(group)
        state = perturbed_state(tiny_model_path)
        for bucket in bucketize(sorted(state.items()), bucket_bytes=64 << 10):
            group.call("import_weights", [bucket])
        out = self._generate(group)
        ref = reference_logprobs(tiny_model_path, state, samples_batch(out))
        self._close(
            max_sample_logprob_diff(out, ref),
            "generate's log-probs after import_weights against transformers on those weights",
        )
        before = reference_logprobs(tiny_model_path, None, samples_batch(out))
        assert max_sample_logprob_diff(out, before) > 100 * self.logprob_tolerance, (
            "after import_weights the engine still samples with the weights it loaded"
        )

    # -- trainers --------------------------------------------------------------------------

    def _export(self, group: WorkerGroup) -> dict[str, torch.Tensor]:
        return export_state(group)

    def test_export_weights_equal_loaded_checkpoint(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any], tiny_model_path: str
    ) -> None:
        self.require(spec_and_config, "train")

        group = start()
        exported = self._export(group)
        expected = load_file(os.path.join(tiny_model_path, "model.safetensors"))
        missing = sorted(set(expected) - set(exported))
        assert not missing, f"export_weights leaves out {missing[:5]} (HF names expected)"
        dtypes = {n: (exported[n].dtype, t.dtype) for n, t in expected.items()}
        wrong = {n: d for n, d in dtypes.items() if d[0] != d[1]}
        assert not wrong, f"export_weights' dtypes (got, checkpoint's): {wrong}"
        gap = state_difference({n: exported[n] for n in expected}, expected)
        assert not gap, f"export_weights right after load differ from the checkpoint: {gap}"

    def test_adapter_sync_exports_the_adapters_alone(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any], tiny_model_path: str
    ) -> None:
        """With ``lora.sync: adapter`` a sync holds every adapted module's ``lora_A`` (rank x
        in) and ``lora_B`` (out x rank), named by the module's HF name, and no base weight;
        right after load ``B`` is zero, so the engine's base alone is the policy."""
        self.require(spec_and_config, "train")
        if self.lora is None or self.lora.sync != "adapter":
            pytest.skip("the class's lora does not sync adapters alone (lora.sync: adapter)")

        exported = self._export(start())
        base = load_file(os.path.join(tiny_model_path, "model.safetensors"))
        targets = set(self.lora.target_modules)
        adapted = {
            n.removesuffix(".weight")
            for n in base
            if n.endswith(".weight") and n.split(".")[-2] in targets
        }
        parts = {name: parse_adapter_wire_name(name) for name in exported}
        assert all(parts.values()), f"not adapters: {[n for n, p in parts.items() if not p]}"
        modules = {part[0] for part in parts.values() if part}
        assert modules == adapted, f"adapted modules sent {sorted(modules ^ adapted)[:5]} apart"
        rank = self.lora.rank
        for module in sorted(adapted):
            out_features, in_features = base[f"{module}.weight"].shape
            a, b = exported[f"{module}.lora_A.weight"], exported[f"{module}.lora_B.weight"]
            assert tuple(a.shape) == (rank, in_features), f"{module}.lora_A: {tuple(a.shape)}"
            assert tuple(b.shape) == (out_features, rank), f"{module}.lora_B: {tuple(b.shape)}"
            assert not b.any(), f"{module}.lora_B is not zero right after load"
            assert a.abs().sum() > 0, f"{module}.lora_A is all zero: it would never train"

    def test_train_then_sync_to_hf_infer_logprob_parity(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any]
    ) -> None:
        self.require(spec_and_config, "train")

        trainer = start()
        batch = synthetic_train_batch(dp_size=trainer.dp_size)
        metrics = trainer.call_dp("train_step", batch.split(trainer.dp_size))
        not_floats = {k: v for k, v in metrics[0].items() if not isinstance(v, float)}
        assert not not_floats, f"train_step's metrics must be floats: {not_floats}"
        self._check_replicas(trainer)
        rollout = start("hf_infer", world_size=1, role="actor_infer")
        stats = SharedMemoryTransport(bucket_bytes=64 << 10).run(trainer, rollout)
        assert stats["buckets"] >= 1
        out = self._generate(rollout)
        sample_batch = samples_batch(out)

        per = len(sample_batch) // trainer.dp_size
        shares = [
            sample_batch.select(list(range(i * per, (i + 1) * per))) for i in range(trainer.dp_size)
        ]
        got = concat_tensor_rows(trainer.call_dp("compute_logprobs", shares))
        self._close(
            max_sample_logprob_diff(out, got),
            "hf_infer's log-probs after the weight sync against the trainer's own",
        )

    def _check_replicas(self, group: WorkerGroup) -> None:
        """After a step every data-parallel rank holds the same model: each rank's log-probs
        of the same rows agree with rank 0's."""
        if group.dp_size < 2:
            return
        batch = synthetic_train_batch(seed=5)
        answers = group.call_dp("compute_logprobs", [batch] * group.dp_size)
        for dp_rank, got in enumerate(answers[1:], start=1):
            gap = float(((got - answers[0]) * batch.attention_mask).abs().max())
            if gap > self.logprob_tolerance:
                pytest.fail(
                    f"after one train_step, data-parallel rank {dp_rank}'s log-probs of the "
                    f"same rows differ from rank 0's by {gap:.3g}: the replicas drifted apart "
                    "(are the gradients all-reduced across data-parallel ranks?)",
                    pytrace=False,
                )

    def test_train_then_in_process_sync_logprob_parity(
        self, spec_and_config: SpecAndConfig, start: Callable[..., Any]
    ) -> None:
        """Hybrid engine: hf_infer in the trainer's own rank processes; after a step, the
        in-process hand-over gives it the trainer's weights exactly (every rank a replica)."""
        self.require(spec_and_config, "train")
        if not spec_and_config[0].capabilities.shares_process:
            pytest.skip(f"{self.strategy} does not declare Capabilities.shares_process")

        trainer, rollout = start(beside=("hf_infer", "actor_infer"))
        assert trainer.shares_processes_with(rollout)
        batch = synthetic_train_batch(dp_size=trainer.dp_size)
        trainer.call_dp("train_step", batch.split(trainer.dp_size))
        stats = InProcessTransport(bucket_bytes=64 << 10).run(trainer, rollout)
        assert stats["buckets"] >= 1
        out = self._generate(rollout)
        sample_batch = samples_batch(out)
        per = len(sample_batch) // trainer.dp_size
        shares = [
            sample_batch.select(list(range(i * per, (i + 1) * per))) for i in range(trainer.dp_size)
        ]
        got = concat_tensor_rows(trainer.call_dp("compute_logprobs", shares))
        self._close(
            max_sample_logprob_diff(out, got),
            "hf_infer's log-probs after the weight sync against the trainer's own",
        )

    def _rollout_checkpoint_round_trip(
        self, start: Callable[..., Any], model_path: str, path: str
    ) -> None:

        first = start()
        for bucket in bucketize(sorted(perturbed_state(model_path).items()), 64 << 10):
            first.call("import_weights", [bucket])
        first.call("save_checkpoint", path)
        second = start()
        second.call("load_checkpoint", path)
        a, b = self._generate(first), self._generate(second)
        assert a.response_ids == b.response_ids, "samples after load_checkpoint differ"
        assert a.response_logprobs == b.response_logprobs, "log-probs after load differ"

    def test_checkpoint_round_trip_is_exact(
        self,
        spec_and_config: SpecAndConfig,
        start: Callable[..., Any],
        tmp_path: pathlib.Path,
        tiny_model_path: str,
    ) -> None:
        supports = self.supports_checkpoint
        if supports is None:
            supports = self.kind(spec_and_config) == "train"
        if not supports:
            pytest.skip(f"{self.strategy} keeps no training state")
        if self.kind(spec_and_config) == "rollout":
            self._rollout_checkpoint_round_trip(start, tiny_model_path, str(tmp_path / "ckpt"))
            return

        problems = self._resume_problems(start, str(tmp_path / "ckpt"))
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)

    def _step(self, group: WorkerGroup, seed: int) -> dict[str, float]:
        batch = synthetic_train_batch(seed=seed, dp_size=group.dp_size)
        return group.call_dp("train_step", batch.split(group.dp_size))[0]

    def _resume_problems(self, start: Callable[..., Any], path: str) -> list[str]:
        """A trainer saved after two steps, loaded by a fresh group: the loaded group's next
        steps must equal the uninterrupted one's bitwise, with warmup and decay, and clipping
        that acts (:data:`RESUME_TRAINING`). Each difference is named with the state it
        points at: weights, learning-rate schedule, optimizer state, random state. On the way,
        the uninterrupted group releases and resumes its memory (as around another role's
        phase on shared GPUs), which must change nothing."""
        first = start(training_args=RESUME_TRAINING)
        for seed in (0, 1):  # through the warmup: the optimizer has moments, the rate moved
            metrics = self._step(first, seed)
        problems = self._reported_metrics(metrics)
        first.call("save_checkpoint", path)
        saved = self._export(first)
        saved_rng = first.call("run_function", f"{rng_fingerprint.__module__}:rng_fingerprint")
        problems += self._release_resume_problems(first, saved)

        second = start(training_args=RESUME_TRAINING)
        second.call("load_checkpoint", path)
        if gap := state_difference(self._export(second), saved):
            return [*problems, f"weights after load_checkpoint differ from those saved: {gap}"]
        loaded_rng = second.call("run_function", f"{rng_fingerprint.__module__}:rng_fingerprint")
        if loaded_rng != saved_rng:
            differing = [r for r, (a, b) in enumerate(zip(saved_rng, loaded_rng)) if a != b]
            problems.append(
                f"random state after load_checkpoint differs from the one saved on rank(s) "
                f"{differing}: save rng_state(worker) with the checkpoint and "
                "restore_rng_state(worker, ...) on load (posttrain.backend)"
            )
        for seed in (2, 3):
            expected, got = self._step(first, seed), self._step(second, seed)
            step = f"step {seed + 1} (the {'first' if seed == 2 else 'second'} after the load)"
            if problem := self._step_difference(step, got, expected, first, second):
                return [*problems, problem]
        return problems

    def _reported_metrics(self, metrics: dict[str, float]) -> list[str]:
        prefix = "actor"  # the role the resume contract trains
        missing = [f"{prefix}/{k}" for k in ("lr", "grad_norm") if f"{prefix}/{k}" not in metrics]
        problems = []
        if missing:
            problems.append(
                f"train_step reports no {', '.join(missing)} (f'{{worker.metric_prefix}}/lr', "
                "'/grad_norm': the rate the step used and the gradients' norm before clipping)"
            )
        norm = metrics.get(f"{prefix}/grad_norm")
        if norm is not None and not norm > RESUME_TRAINING.max_grad_norm:
            problems.append(
                f"{prefix}/grad_norm {norm} is not above max_grad_norm "
                f"{RESUME_TRAINING.max_grad_norm}: report the norm before clipping"
            )
        return problems

    def _release_resume_problems(
        self, group: WorkerGroup, before: dict[str, torch.Tensor]
    ) -> list[str]:
        """release_memory then resume_memory of every tag: both answer True and the weights
        (and, checked by the steps after, the optimizer state) come back unchanged."""
        tags = list(MEMORY_TAGS)
        problems = []
        for call in ("release_memory", "resume_memory"):
            answers = group.call(call, tags)
            if not all(answer is True for answer in answers):
                problems.append(
                    f"{call}({tags}) answered {answers}, not True on every rank: a trainer "
                    f"implements {call} (None: no hook answered), since colocated roles share "
                    "GPUs and each phase needs the others' memory"
                )
        if gap := state_difference(self._export(group), before):
            problems.append(f"weights after release_memory + resume_memory differ: {gap}")
        return problems

    def _step_difference(
        self,
        step: str,
        got: dict[str, float],
        expected: dict[str, float],
        first: WorkerGroup,
        second: WorkerGroup,
    ) -> str:
        """What differs after ``step`` between the loaded group (``got``: its metrics) and the
        uninterrupted one (``expected``), by the first state that explains it."""
        for name in sorted(expected):
            if not name.endswith(("/lr", "/grad_norm")) or got.get(name) == expected[name]:
                continue
            cause = (
                "the learning-rate scheduler's state is not saved and restored"
                if name.endswith("/lr")
                else "the weights or the random state the step sees differ"
            )
            return f"{name} at {step}: {got.get(name)}, expected {expected[name]}: {cause}"
        if gap := state_difference(self._export(second), self._export(first)):
            return (
                f"weights after {step} differ from the uninterrupted engine's ({gap}) though "
                "its lr and grad_norm agree: the optimizer state (e.g. Adam's moments and "
                "step counts) is not saved and restored, or is lost in "
                "release_memory/resume_memory"
            )
        return ""

    # -- critics (a trainer with a value head) ---------------------------------------------

    def _value_step(self, group: WorkerGroup, seed: int = 0) -> None:
        """One value-loss step on :func:`value_train_batch` at the critic's current values."""
        batch = value_train_batch(group, seed)
        group.call_dp("train_step", batch.split(group.dp_size))

    def test_critic_values_match_transformers_forward(
        self, critic: Critic, tmp_path: pathlib.Path
    ) -> None:
        """The head starts at zero on a checkpoint without one; after a step moved the head and
        the backbone, the values equal a transformers value model's of the exported weights."""

        group, initial = critic
        head = initial["export"][HEAD_WEIGHT]
        assert head.shape[0] == 1 and not bool(head.any())
        assert not bool(initial["values"].any())
        self._value_step(group)
        path = str(tmp_path / "hf")
        group.call("export_hf", path)
        probe = value_probe()
        got = group_values(group, probe)
        ref = reference_values(path, probe)
        assert float(got.abs().max()) > 1e-3  # not trivially equal
        self._close(float((got - ref).abs().max()), "compute_logprobs against transformers")
        # Weight sync's buckets carry the same HF names and tensors as the directory.
        exported, written = export_state(group), load_file(os.path.join(path, "model.safetensors"))
        assert exported.keys() == written.keys()
        assert all(torch.equal(exported[k], written[k]) for k in written)
        assert bool(written[HEAD_WEIGHT].any())

    def test_critic_checkpoint_round_trip_is_exact(
        self, critic: Critic, tmp_path: pathlib.Path
    ) -> None:
        """Values after a load equal those at the save bitwise, and the step after it repeats
        the original step bitwise (optimizer and schedule restored with the weights)."""

        group, _ = critic
        self._value_step(group)  # the optimizer has state to save
        path = str(tmp_path / "ckpt")
        group.call("save_checkpoint", path)
        probe = value_probe()
        saved = group_values(group, probe)
        self._value_step(group, seed=1)
        moved = group_values(group, probe)
        assert not torch.equal(saved, moved)
        group.call("load_checkpoint", path)
        assert torch.equal(group_values(group, probe), saved), "values after load differ"
        self._value_step(group, seed=1)
        assert torch.equal(group_values(group, probe), moved), (
            "the value step after load differs from the original's: the optimizer or schedule "
            "is not restored"
        )

    def test_critic_value_step_reduces_value_loss(self, critic: Critic) -> None:
        """Steps on one batch (the loop's ValueLoss) lower its value loss step after step."""
        group, _ = critic
        batch = value_train_batch(group, seed=3)
        losses = []
        for _ in range(4):
            losses.append(masked_value_loss(group_values(group, batch), batch))
            metrics = group.call_dp("train_step", batch.split(group.dp_size))
            reported = sum(m["critic/vf_loss"] for m in metrics)
            assert abs(reported - losses[-1]) <= 1e-4 * max(1.0, losses[-1])
            assert metrics[0]["critic/grad_norm"] > 0
        losses.append(masked_value_loss(group_values(group, batch), batch))
        assert all(b < a for a, b in itertools.pairwise(losses)), losses
        assert losses[-1] < 0.75 * losses[0], losses
