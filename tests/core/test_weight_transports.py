"""Weight transports between real local worker groups (separate processes, and roles sharing
processes: the hybrid engine), and how worker failures surface.

The source is ``contract_fake_export`` (tests/core/export_source_plugin.py, a FAKE trainer that
exports a seeded perturbation of the tiny model); the target is ``hf_infer`` with two ranks.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from posttrain.config.sections import (
    AlgorithmConfig,
    GeneratingArgs,
    ModelArgs,
    RoleConfig,
    StrategyArgs,
)
from posttrain.errors import WorkerError
from posttrain.launch.base import GroupSpec
from posttrain.launch.local import LocalLauncher
from posttrain.protocol import WeightBucket, bucketize
from posttrain.testing.expected import reference_logprobs, synthetic_train_batch
from posttrain.weight_sync.transport import (
    BroadcastTransport,
    InProcessTransport,
    SharedMemoryTransport,
)
from posttrain_hf_infer.plugin import HFInferConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET_BYTES = 64 << 10
SCALE = 0.05


def _spec(role, strategy, config, ranks, model_path, run_dir, plugins=()) -> GroupSpec:
    role_config = RoleConfig(
        strategy_args=StrategyArgs(strategy_name=strategy, strategy_config=config),
        device_mapping=tuple(range(ranks)),
        model_args=ModelArgs(model_name_or_path=model_path),
        generating_args=GeneratingArgs(),
    )
    return GroupSpec(
        role=role,
        config=role_config,
        algorithm=AlgorithmConfig(),
        seed=1234,
        run_dir=str(run_dir),
        base_dir=str(run_dir),
        device="cpu",
        plugins=plugins,
        threads=1,
    )


@pytest.fixture(scope="module")
def plugin_module():
    import sys

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import export_source_plugin

    return export_source_plugin


@pytest.fixture(scope="module")
def groups(tiny_model_path, tmp_path_factory, plugin_module):
    """(source, target): the fake exporter (1 rank) and hf_infer (2 ranks)."""
    run_dir = tmp_path_factory.mktemp("transports")
    with pytest.MonkeyPatch.context() as mp:
        # Spawned worker processes inherit the environment: they can import the plugin.
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
        launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=180)
        try:
            source = launcher.start_group(
                _spec(
                    "actor_train",
                    plugin_module.STRATEGY,
                    plugin_module.ContractFakeExportConfig(scale=SCALE),
                    1,
                    tiny_model_path,
                    run_dir,
                    plugins=("export_source_plugin",),
                )
            )
            target = launcher.start_group(
                _spec("actor_infer", "hf_infer", HFInferConfig(), 2, tiny_model_path, run_dir)
            )
            yield source, target
        finally:
            launcher.shutdown()


@pytest.fixture(scope="module")
def local_model(tiny_model_path):
    from posttrain.backends.models import load_causal_lm

    return load_causal_lm(ModelArgs(model_name_or_path=tiny_model_path)).eval()


def _expected(plugin_module, model, seed):
    weights = plugin_module.perturbed_weights(model, seed, SCALE)
    buckets = list(bucketize(weights, BUCKET_BYTES))
    stats = {
        "bytes": sum(t.numel() * t.element_size() for _, t in weights),
        "buckets": len(buckets),
    }
    return dict(weights), stats


def _check_target(target, model_path, state):
    batch = synthetic_train_batch()
    ref = reference_logprobs(model_path, state, batch)
    answers = target.call("compute_logprobs", batch)
    assert len(answers) == 2
    for rank, got in enumerate(answers):
        diff = float((got * batch.attention_mask - ref).abs().max())
        assert diff <= 1e-5, f"rank {rank}: max |diff| = {diff}"


def _sync_and_check(transport, groups, plugin_module, local_model, tiny_model_path, seed):
    source, target = groups
    source.call("run_function", "export_source_plugin:set_export_seed", seed)
    state, expected = _expected(plugin_module, local_model, seed)
    assert expected["buckets"] > 2  # the tiny model does not fit one 64 KiB bucket
    stats = transport.run(source, target)
    # (the rollout side checked buckets against the trainer's byte sums: posttrain.weight_sync.
    # verify; the shared-memory path, driven bucket by bucket, does not count them)
    stats.pop("verified", None)
    assert stats == expected
    _check_target(target, tiny_model_path, state)
    return stats


@pytest.fixture(scope="module")
def shared_groups(tiny_model_path, tmp_path_factory, plugin_module):
    """(source, target) of 2 ranks each, hosted by the same 2 rank processes."""
    run_dir = tmp_path_factory.mktemp("in-process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
        launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=180)
        try:
            groups = launcher.start_processes(
                [
                    _spec(
                        "actor_train",
                        plugin_module.STRATEGY,
                        plugin_module.ContractFakeExportConfig(scale=SCALE),
                        2,
                        tiny_model_path,
                        run_dir,
                        plugins=("export_source_plugin",),
                    ),
                    _spec("actor_infer", "hf_infer", HFInferConfig(), 2, tiny_model_path, run_dir),
                ]
            )
            yield launcher, groups["actor_train"], groups["actor_infer"]
        finally:
            launcher.shutdown()


def test_in_process_transport_is_one_call_per_rank(
    shared_groups, plugin_module, local_model, tiny_model_path
):
    launcher, source, target = shared_groups
    assert source.shares_processes_with(target)
    assert source.procs == target.procs and len(source.procs) == 2
    transport = InProcessTransport(bucket_bytes=BUCKET_BYTES)
    for seed in (300, 301):  # a second sync must be observable too
        source.call("run_function", "export_source_plugin:set_export_seed", seed)
        state, expected = _expected(plugin_module, local_model, seed)
        calls = launcher.driver_calls()
        stats = transport.run(source, target)
        assert stats.pop("verified") >= 1  # all buckets in a first sync, one in later ones
        assert stats == expected
        assert launcher.driver_calls() - calls == 2  # one call, on each of the 2 processes
        _check_target(target, tiny_model_path, state)


def test_in_process_transport_refuses_groups_in_other_processes(groups):
    with pytest.raises(ValueError, match="same processes"):
        InProcessTransport(bucket_bytes=BUCKET_BYTES).run(*groups)


@pytest.mark.parametrize("transport_cls", [SharedMemoryTransport, BroadcastTransport])
def test_transport_moves_perturbed_weights(
    transport_cls, groups, plugin_module, local_model, tiny_model_path
):
    batch = synthetic_train_batch()
    transport = transport_cls(bucket_bytes=BUCKET_BYTES)
    try:
        base = 100 if transport_cls is BroadcastTransport else 200
        _sync_and_check(transport, groups, plugin_module, local_model, tiny_model_path, base)
        if isinstance(transport, BroadcastTransport):
            assert transport._joined

            def no_second_join(*_):
                raise AssertionError("the broadcast group must be reused")

            transport._join = no_second_join
        # The perturbation is large enough that a missed import would fail the 1e-5 check.
        original = reference_logprobs(tiny_model_path, None, batch)
        got = groups[1].call("compute_logprobs", batch)[1] * batch.attention_mask
        assert float((got - original).abs().max()) > 1e-3
        # A second sync with other weights: the import is observable again, and the broadcast
        # transport reuses its process group.
        _sync_and_check(transport, groups, plugin_module, local_model, tiny_model_path, base + 1)
        first_state, _ = _expected(plugin_module, local_model, base)
        stale = reference_logprobs(tiny_model_path, first_state, batch)
        got = groups[1].call("compute_logprobs", batch)[0] * batch.attention_mask
        assert float((got - stale).abs().max()) > 1e-3
    finally:
        transport.close(*groups)
    if isinstance(transport, BroadcastTransport):
        assert not transport._joined


def test_worker_exception_names_role_and_rank(groups, tiny_model_path):
    _, target = groups
    bad = WeightBucket([("model.no_such_weight", torch.zeros(2))])
    with pytest.raises(WorkerError) as err:
        target.call("import_weights", [bad])
    assert err.value.role == "actor_infer"
    assert err.value.rank in (0, 1)
    assert str(err.value).startswith(f"actor_infer rank {err.value.rank}: KeyError")
    assert "no_such_weight" in str(err.value)
    assert "Traceback" in err.value.remote_traceback
    # Calling a method of the source that fails before the export began.
    with pytest.raises(WorkerError, match=r"actor_train rank 0: .*before export_begin"):
        groups[0].call("export_next")
    # The groups still serve calls afterwards.
    assert target.call("ping") == ["pong", "pong"]


def test_killed_rank_fails_the_next_call_quickly(tiny_model_path, tmp_path):
    launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=180)
    try:
        group = launcher.start_group(
            _spec("actor_infer", "hf_infer", HFInferConfig(), 2, tiny_model_path, tmp_path)
        )
        assert group.call("ping") == ["pong", "pong"]
        group.procs[0].kill()
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            group.call("compute_logprobs", synthetic_train_batch())
        assert time.monotonic() - start < 15
        assert err.value.role == "actor_infer" and err.value.rank == 0
        assert "died of SIGKILL" in str(err.value)
    finally:
        launcher.shutdown()


def test_dead_shared_process_names_every_role_it_hosted(tiny_model_path, tmp_path):
    launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=180)
    try:
        specs = [
            _spec(role, "hf_infer", HFInferConfig(), 1, tiny_model_path, tmp_path)
            for role in ("actor_infer", "reference")
        ]
        groups = launcher.start_processes(specs)
        assert (tmp_path / "logs" / "actor_infer+reference.rank0.log").exists()
        groups["reference"].procs[0].kill()
        with pytest.raises(WorkerError) as err:
            groups["actor_infer"].call("compute_logprobs", synthetic_train_batch())
        assert err.value.roles == ("actor_infer", "reference")
        assert str(err.value).startswith(
            "actor_infer rank 0 (its process also hosted reference): worker process died of SIGKILL"
        )
    finally:
        launcher.shutdown()
