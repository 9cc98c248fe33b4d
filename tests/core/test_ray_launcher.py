"""The ray launcher: partial overlap refused by validate (without importing Ray), placement of
colocated roles on shared bundles, one actor hosting two roles (hybrid engine), rank
environment, logs, and errors naming role/rank/node and every role of a dead actor."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from posttrain.errors import WorkerError
from posttrain.launch.base import partial_overlaps

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def test_partial_overlaps_allows_equal_subset_and_disjoint_mappings():
    def roles(**maps):
        return {name: SimpleNamespace(device_mapping=tuple(m)) for name, m in maps.items()}

    assert partial_overlaps(roles(a=[0, 1], b=[0, 1], c=[1], d=[2, 3])) == []
    found = partial_overlaps(roles(a=[0, 1], b=[1, 2]))
    assert [(a, b) for a, b, _ in found] == [("a", "b")]
    assert "overlap only in part" in found[0][2]


def _validate(*overrides: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """\
        import sys
        from posttrain.cli import main
        rc = main(["validate", *sys.argv[1:]])
        print(f"RESULT rc={rc} ray={'ray' in sys.modules} torch={'torch' in sys.modules}")
        """
    )
    sets = [item for o in overrides for item in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-c", code, str(QUICKSTART), *sets],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_validate_refuses_partial_overlap_with_ray_only_and_imports_no_ray():
    partial = "actor_infer.device_mapping=[1,2]"
    proc = _validate("cluster.launcher=ray", partial)
    out = proc.stdout + proc.stderr
    assert "RESULT rc=2 ray=False torch=False" in out, out
    assert "actor_infer.device_mapping: actor_train.device_mapping [0, 1] and" in out
    assert "overlap only in part" in out
    proc = _validate("cluster.launcher=local", partial)
    assert "RESULT rc=0 ray=False" in proc.stdout, proc.stdout + proc.stderr
    proc = _validate("cluster.launcher=ray")
    assert "RESULT rc=0 ray=False" in proc.stdout, proc.stdout + proc.stderr


def test_devices_per_node_is_refused_without_ray():
    proc = _validate("cluster.devices_per_node=2")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "RESULT rc=2 ray=False" in out, out
    assert "cluster.devices_per_node: 2 with cluster.launcher: local: only the ray launcher" in out
    assert "set cluster.launcher: ray (docs/multi-node.md), or leave devices_per_node out" in out
    proc = _validate("cluster.launcher=ray", "cluster.devices_per_node=2")
    assert "RESULT rc=0 ray=False" in proc.stdout, proc.stdout + proc.stderr


def _node(node_id, ip, cpus=2.0, gpus=0.0, head=False, alive=True) -> dict:
    """A node as ray.nodes() describes it."""
    resources = {"CPU": cpus, "GPU": gpus, **({"node:__internal_head__": 1.0} if head else {})}
    return {
        "NodeID": node_id,
        "NodeManagerAddress": ip,
        "Alive": alive,
        "Resources": resources,
        "Labels": {"ray.io/node-id": node_id},
    }


def test_devices_per_node_fills_the_head_then_nodes_by_ip():
    pytest.importorskip("ray")
    from posttrain.launch.ray import live_nodes, nodes_for_devices

    nodes = live_nodes(
        [
            _node("b2", "10.0.0.10"),
            _node("dead", "10.0.0.1", alive=False),
            _node("b1", "10.0.0.9"),
            _node("a", "10.0.0.20", head=True),
            _node("c0", "10.0.0.9"),  # a second node of one host: by node id after b1
        ]
    )
    assert [n.node_id for n in nodes] == ["a", "b1", "c0", "b2"]
    placed = nodes_for_devices([0, 1, 2, 3, 4], 2, nodes, gpu=False, where="the cluster")
    assert {d: n.node_id for d, n in placed.items()} == {0: "a", 1: "a", 2: "b1", 3: "b1", 4: "c0"}
    # On GPUs, a head without GPUs takes no devices; nodes with fewer than 8 neither.
    gpus = live_nodes(
        [
            _node("head", "10.0.0.1", head=True),
            _node("w1", "10.0.0.2", gpus=8),
            _node("small", "10.0.0.3", gpus=4),
            _node("w2", "10.0.0.4", gpus=8),
        ]
    )
    placed = nodes_for_devices(range(16), 8, gpus, gpu=True, where="the cluster")
    assert [placed[d].node_id for d in (0, 7, 8, 15)] == ["w1", "w1", "w2", "w2"]


def test_too_few_nodes_names_them_and_what_to_do():
    pytest.importorskip("ray")
    from posttrain.errors import UserError
    from posttrain.launch.ray import live_nodes, nodes_for_devices

    one = live_nodes([_node("0315da53a058b544", "192.0.2.2", head=True)])
    with pytest.raises(UserError) as raised:
        nodes_for_devices([0, 1], 1, one, gpu=False, where="cluster.address auto")
    assert str(raised.value) == (
        "cluster.devices_per_node: 1 puts device_mapping device 1 on node 2, but "
        "cluster.address auto has 1 node with CPUs (192.0.2.2 [Ray node 0315da53]: 2 CPUs); "
        "start 1 more (ray start --address=HEAD_IP:PORT on each: docs/multi-node.md), or set "
        "cluster.devices_per_node to 2 or more"
    )
    # On GPUs, a larger devices_per_node is suggested only where the nodes have the GPUs.
    eight = live_nodes([_node("w1", "10.0.0.2", gpus=8, head=True)])
    with pytest.raises(UserError) as raised:
        nodes_for_devices(range(16), 8, eight, gpu=True, where="the cluster")
    text = str(raised.value)
    assert "has 1 node with at least 8 GPUs (10.0.0.2 [Ray node w1]: 8 GPUs); start 1 more" in text
    assert "or set" not in text


@pytest.fixture(scope="module")
def ray_setup(posttrain_cache, tmp_path_factory):
    pytest.importorskip("ray")
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.launch.ray import RayLauncher
    from posttrain.loading.workflow import load_workflow

    host = create_plugin_host()
    overrides = {
        "cluster.launcher": "ray",
        "cluster.num_cpus": 2,
        "cluster.object_store_memory": 256 << 20,
        "cluster.call_timeout_s": 60,
        "cluster.runtime_env": {
            "env_vars": {"PT_TEST_VAR": 7, "PYTHONPATH": str(Path(__file__).parent)}
        },
        "actor_infer.device_mapping": [0],
        "reference.device_mapping": [0],
    }
    workflow, report = load_workflow(str(QUICKSTART), host, overrides)
    assert workflow is not None, report
    plan = [("actor_train",), ("actor_infer", "reference")]
    launcher = RayLauncher(workflow.cluster, workflow.roles(), "cpu", plan)
    yield workflow, launcher, tmp_path_factory.mktemp("ray-run")
    launcher.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colocated_roles_share_bundles(ray_setup):
    _, launcher, _ = ray_setup
    train = launcher.placements[("actor_train",)]
    shared = launcher.placements[("actor_infer", "reference")]
    assert train.pg is shared.pg
    assert (train.bundles, shared.bundles) == ([0, 1], [0])
    # 2 CPUs, 2 bundles: half the CPUs in bundles (0.5 each); bundle 0 split between its 2
    # actors (the two roles of the shared actor count once), bundle 1 all actor_train's.
    assert train.cpus == [0.25, 0.5] and shared.cpus == [0.25]
    assert train.gpus == [0, 0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_launcher_says_which_ray_cluster_it_uses(ray_setup):
    import ray

    _, launcher, _ = ray_setup
    line = launcher.description()
    address = ray.get_runtime_context().gcs_address
    assert line.startswith(f"ray: a local cluster started for this run ({address}), 1 node ")
    assert "(2 CPUs, 0 GPUs)" in line, line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_group_env_logs_and_errors(ray_setup):
    from posttrain.launch.plan import group_spec

    workflow, launcher, run_dir = ray_setup
    groups = launcher.start_processes(
        [
            group_spec(workflow, name, getattr(workflow, name), str(run_dir), "cpu")
            for name in ("actor_infer", "reference")
        ]
    )
    group, other = groups["actor_infer"], groups["reference"]
    assert group.shares_processes_with(other)
    assert group.call("ping") == other.call("ping") == ["pong"]
    env = group.call("run_function", "ray_rank_helpers:rank_env")[0]
    assert env["MASTER_ADDR"] == group.master_address() != ""
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["PT_TEST_VAR"]) == (
        "0",
        "1",
        "0",
        "7",
    )
    log = run_dir / "logs" / "actor_infer+reference.rank0.log"
    assert "rank_env called on rank 0" in log.read_text()

    with pytest.raises(WorkerError) as raised:
        group.call("run_function", "ray_rank_helpers:boom")
    text = f"{raised.value}\n{raised.value.remote_traceback}"
    shared = "actor_infer rank 0 (its process also hosted reference)"
    # The node: its IP, its host and its Ray node id (two nodes of one host differ by that).
    node = rf"\(node {re.escape(group.master_address())} \[[^,\]]+, Ray node [0-9a-f]{{8}}\]\)"
    assert re.search(rf"{re.escape(shared)}: ValueError: boom {node}", text), text
    assert "last lines of" in text and "about to fail" in text

    start = time.monotonic()
    with pytest.raises(WorkerError) as raised:
        group.call("run_function", "ray_rank_helpers:die")
    assert time.monotonic() - start < 30
    text = f"{raised.value}\n{raised.value.remote_traceback}"
    assert f"{shared}: worker actor died during run_function (node " in text
    assert "about to exit" in text
    group.shutdown()
    group.shutdown()  # idempotent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_shutdown_stops_its_ray(ray_setup):
    import ray

    _, launcher, _ = ray_setup
    assert ray.is_initialized()
    launcher.shutdown()
    assert not ray.is_initialized()
    launcher.shutdown()  # idempotent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_placement_that_never_fits_names_the_roles_and_the_cluster(ray_setup):
    """GPU bundles on a cluster of CPUs: refused after start_timeout_s, not waited on forever."""
    import attrs

    from posttrain.errors import UserError
    from posttrain.launch.ray import RayLauncher

    workflow, _, _ = ray_setup
    cluster = attrs.evolve(workflow.cluster, start_timeout_s=2)
    plan = [("actor_train",), ("actor_infer", "reference")]
    with pytest.raises(UserError) as raised:
        RayLauncher(cluster, workflow.roles(), "cuda", plan)
    text = str(raised.value)
    assert "was not placed within 2s" in text, text
    assert "of actor_train" in text and "'GPU': 1.0" in text and "the cluster has" in text
