"""The plugin host: built-ins, entry points (with autoload off and an allowlist), workflow-named
plugins (and those the two settings exclude), and strategy-name conflicts."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap

import attrs
import pytest

from posttrain import ScoringOptions, hookimpl
from posttrain.config.report import ErrorReport
from posttrain.errors import PluginError
from posttrain.host.plugin_host import BUILTIN_PLUGINS, ENTRY_POINT_GROUP, create_plugin_host
from posttrain.host.references import WHERE_MODULES_ARE
from posttrain.host.strategy import Capabilities, StrategySpec
from posttrain.loading.workflow import build_workflow

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`

FAKE_EP_MODULE = "posttrain_contract_fake_ep"
CONTRACT_FAKE_TRAIN = "contract_fake_train"  # declared by conftest's fake plugin


@attrs.frozen(kw_only=True)
class ContractFakeDupConfig:
    pass


def _spec(name: str) -> StrategySpec:
    return StrategySpec(
        name=name, config_class=ContractFakeDupConfig, capabilities=Capabilities(kind="train")
    )


class ContractFakeDupA:
    """Fake plugin for contract tests: declares the same strategy name as ContractFakeDupB."""

    @hookimpl
    def posttrain_add_strategies(self):
        return [_spec("contract_fake_dup")]


class ContractFakeDupB:
    @hookimpl
    def posttrain_add_strategies(self):
        return [_spec("contract_fake_dup")]


@pytest.fixture
def fake_entry_points(tmp_path, monkeypatch):
    """Replace the installed entry points of group 'posttrain' with two fakes: one that loads a
    module from tmp_path (declaring 'contract_fake_ep_train') and one that fails to import."""
    (tmp_path / f"{FAKE_EP_MODULE}.py").write_text(
        textwrap.dedent(
            """\
            import attrs
            from posttrain import hookimpl
            from posttrain.host.strategy import Capabilities, StrategySpec

            @attrs.frozen(kw_only=True)
            class Config:
                pass

            @hookimpl
            def posttrain_add_strategies():
                return [StrategySpec(name="contract_fake_ep_train", config_class=Config,
                                     capabilities=Capabilities(kind="train"))]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, FAKE_EP_MODULE, raising=False)
    eps = importlib.metadata.EntryPoints(
        [
            importlib.metadata.EntryPoint("fake_ok", FAKE_EP_MODULE, ENTRY_POINT_GROUP),
            importlib.metadata.EntryPoint(
                "fake_broken", "posttrain_contract_no_such_module", ENTRY_POINT_GROUP
            ),
        ]
    )

    def entry_points(**params):
        assert params == {"group": ENTRY_POINT_GROUP}
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.delenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("POSTTRAIN_PLUGINS", raising=False)
    yield
    sys.modules.pop(FAKE_EP_MODULE, None)


def test_builtins_are_registered_first():
    host = create_plugin_host()
    builtin = [p.name for p in host.plugins if p.source == "builtin"]
    assert builtin == [name.partition(":")[0] for name in BUILTIN_PLUGINS]
    # hf_infer is a plugin like the others: found through its entry point.
    assert host.strategies()["hf_infer"].plugin == "hf_infer"
    assert host.strategies()["hf_infer"].capabilities.kind == "rollout"


def test_entry_points_are_loaded_and_failures_named(fake_entry_points):
    host = create_plugin_host()
    by_name = {p.name: p for p in host.plugins}
    assert by_name["fake_ok"].source == "entry point" and by_name["fake_ok"].error == ""
    assert "contract_fake_ep_train" in host.strategies()
    assert host.strategies()["contract_fake_ep_train"].plugin == "fake_ok"
    assert [p.name for p in host.failures] == ["fake_broken"]
    assert "ModuleNotFoundError" in by_name["fake_broken"].error
    # A broken plugin does not take the others down: fake_ok's strategy is there (above).


def test_disable_autoload_loads_no_entry_point(fake_entry_points, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host()
    assert [p for p in host.plugins if p.source != "builtin"] == []
    assert FAKE_EP_MODULE not in sys.modules
    assert host.strategies() == {}  # core alone ships no engine
    assert host.failures == []


def test_disable_autoload_with_real_entry_points(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host()
    assert {p.source for p in host.plugins} == {"builtin"}
    assert host.strategies() == {}  # core alone ships no engine: `pip install ./core` lists none


def test_allowlist_loads_only_named_entry_points(fake_entry_points, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "fake_ok")
    host = create_plugin_host()
    assert [p.name for p in host.plugins if p.source == "entry point"] == ["fake_ok"]
    assert host.failures == []


def test_two_plugins_declaring_one_strategy_is_an_error(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host(extra_plugins=[ContractFakeDupA(), ContractFakeDupB()])
    with pytest.raises(PluginError) as info:
        host.strategies()
    message = str(info.value)
    assert "'contract_fake_dup'" in message
    assert "'ContractFakeDupA'" in message and "'ContractFakeDupB'" in message


def test_strategy_conflict_is_a_validation_error(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host(extra_plugins=[ContractFakeDupA(), ContractFakeDupB()])
    report = ErrorReport()
    build_workflow({"trainer": {"max_steps": 1}}, host, report, base_dir=str(tmp_path))
    plugin_errors = [i for i in report.errors if i.path == "plugins"]
    assert len(plugin_errors) == 1
    assert "ContractFakeDupA" in plugin_errors[0].message


def test_workflow_plugins_load_a_module_for_the_run(monkeypatch, tmp_path, model_dir):
    module = "posttrain_contract_fake_workflow_plugin"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """\
            import attrs
            from posttrain import hookimpl
            from posttrain.host.strategy import Capabilities, StrategySpec

            @attrs.frozen(kw_only=True)
            class Config:
                tensor_model_parallel_size: int = 1

            @attrs.frozen(kw_only=True)
            class InferConfig:
                pass

            @hookimpl
            def posttrain_add_strategies():
                return [StrategySpec(
                    name="contract_fake_workflow_train", config_class=Config,
                    capabilities=Capabilities(
                        kind="train", parallel_dims=("tensor_model_parallel_size",))),
                    StrategySpec(name="contract_fake_workflow_infer", config_class=InferConfig,
                                 capabilities=Capabilities(kind="rollout"))]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host()
    assert "contract_fake_workflow_train" not in host.strategies()
    raw = {
        "plugins": [module],
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {}},
        "algorithm": {"group_size": 2, "rollout_batch_size": 4},
        "actor_train": {
            "strategy_args": {
                "strategy_name": "contract_fake_workflow_train",
                "strategy_config": {"tensor_model_parallel_size": 2},
            },
            "device_mapping": "list(range(4))",
        },
        "actor_infer": {
            "strategy_args": {"strategy_name": "contract_fake_workflow_infer"},
            "device_mapping": [0],
        },
    }
    try:
        workflow, report = build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))
    finally:
        sys.modules.pop(module, None)
    assert report.errors == []
    assert workflow.plugins == [module]
    assert workflow.actor_train.strategy_args.strategy_config.tensor_model_parallel_size == 2
    info = next(p for p in host.plugins if p.name == module)
    assert info.source == "workflow"
    assert host.strategies()["contract_fake_workflow_train"].plugin == module


def test_missing_workflow_plugin_gets_an_install_hint(monkeypatch, tmp_path):
    # posttrain-sglang lives in an environment of its own, never in the main one.
    try:
        __import__("posttrain_sglang")
        pytest.skip("posttrain_sglang is installed")
    except ImportError:
        pass
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host()
    report = ErrorReport()
    raw = {"plugins": ["posttrain_sglang", "no_such_plugin_module_xyz"]}
    build_workflow(raw, host, report, base_dir=str(tmp_path))
    by_path = {i.path: i for i in report.errors}
    assert "neither installed nor importable" in by_path["plugins[0]"].message
    assert by_path["plugins[0]"].hint.startswith("install posttrain-sglang")
    assert "pip install ./plugins/sglang" in by_path["plugins[0]"].hint
    assert by_path["plugins[1]"].hint == WHERE_MODULES_ARE


def test_extra_plugin_strategy_is_tagged_with_its_plugin(
    fake_train_host, contract_fake_train_plugin
):
    plugin_name = type(contract_fake_train_plugin).__name__
    spec = fake_train_host.strategies()[CONTRACT_FAKE_TRAIN]
    assert spec.plugin == plugin_name
    assert spec.capabilities.parallel_dims == ("tensor_model_parallel_size",)
    assert fake_train_host.hooks_of(plugin_name) == ["posttrain_add_strategies"]


@pytest.fixture
def installed_fake_plugin(tmp_path, monkeypatch):
    """One installed distribution, 'posttrain-contract-fake', whose entry point 'fake_ok' is the
    module of ``fake_entry_points``: the entry points come from real dist-info metadata, so they
    carry their distribution's name as installed ones do."""
    dist_info = tmp_path / "posttrain_contract_fake-0.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Name: posttrain-contract-fake\nVersion: 0.3\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nfake_ok = {FAKE_EP_MODULE}\n"
    )
    eps = importlib.metadata.PathDistribution(dist_info).entry_points

    def entry_points(**params):
        assert params == {"group": ENTRY_POINT_GROUP}
        return eps.select(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@pytest.mark.parametrize(
    ("variable", "value", "hint"),
    [
        ("POSTTRAIN_PLUGINS", "someone_else", "add 'fake_ok' to POSTTRAIN_PLUGINS, or unset it"),
        ("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1", "unset POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD"),
    ],
    ids=["allowlist", "autoload_off"],
)
@pytest.mark.parametrize("named", ["fake_ok", "posttrain-contract-fake"], ids=["entry", "dist"])
def test_workflow_naming_an_excluded_plugin_says_why(
    fake_entry_points, installed_fake_plugin, monkeypatch, tmp_path, variable, value, hint, named
):
    monkeypatch.setenv(variable, value)
    host = create_plugin_host()
    report = ErrorReport()
    raw = {"plugins": ["no_such_plugin_module_xyz", named]}
    build_workflow(raw, host, report, base_dir=str(tmp_path))
    issue = next(i for i in report.errors if i.path == "plugins[1]")
    assert issue.message == f"plugin '{named}' is installed but excluded by {variable}={value}"
    assert issue.hint.startswith(hint)
    # The setting wins: the plugin stays unloaded, its module unimported.
    assert FAKE_EP_MODULE not in sys.modules
    assert "contract_fake_ep_train" not in host.strategies()
    assert "neither installed" in next(i for i in report.errors if i.path == "plugins[0]").message


def test_excluded_plugin_error_in_validate_output(
    fake_entry_points, installed_fake_plugin, monkeypatch, write_workflow, capsys
):
    from posttrain.cli import main

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "someone_else")
    assert main(["validate", write_workflow("plugins: [fake_ok]\n")]) == 2
    err = capsys.readouterr().err
    assert (
        "plugins[0]: plugin 'fake_ok' is installed but excluded by POSTTRAIN_PLUGINS=someone_else "
        "(add 'fake_ok' to POSTTRAIN_PLUGINS, or unset it to load every plugin)"
    ) in " ".join(err.split())


def test_a_misspelt_kind_is_refused_where_it_is_written():
    with pytest.raises(PluginError, match=r"not 'inference' \(did you mean 'infer'\?\)"):
        Capabilities(kind="inference")
    with pytest.raises(PluginError, match=r"'train', 'infer' or 'rollout', not 'generator'$"):
        Capabilities(kind="generator")


def test_a_config_declaring_a_shared_option_on_its_own_is_refused_at_declaration():
    """Core reads micro-batch rows and log-prob chunking only through posttrain.ScoringOptions:
    a config that declares one itself would have it ignored inside the workers."""

    @attrs.frozen(kw_only=True)
    class ContractOwnOptionsConfig:
        micro_batch_size: int = 2
        logprob_micro_batch_size: int = 2

    with pytest.raises(PluginError) as caught:
        StrategySpec(
            name="contract_own_options",
            config_class=ContractOwnOptionsConfig,
            capabilities=Capabilities(kind="train"),
        )
    assert str(caught.value) == (
        "ContractOwnOptionsConfig declares micro_batch_size, logprob_micro_batch_size, which core "
        "reads only from posttrain.ScoringOptions: make it `class ContractOwnOptionsConfig("
        "posttrain.ScoringOptions)` (and drop its own declaration unless it changes the default)"
    )

    @attrs.frozen(kw_only=True)
    class ContractInheritedConfig(ScoringOptions):
        micro_batch_size: int | None = 2  # a new default of an inherited option is fine

    spec = StrategySpec(
        name="contract_inherited",
        config_class=ContractInheritedConfig,
        capabilities=Capabilities(kind="train"),
    )
    assert spec.config_class is ContractInheritedConfig
    with pytest.raises(PluginError, match="must be an attrs class"):
        StrategySpec(
            name="contract_dict", config_class=dict, capabilities=Capabilities(kind="train")
        )


class ContractFakeBadKind:
    @hookimpl
    def posttrain_add_strategies(self):
        return [
            StrategySpec(
                name="contract_fake_bad_kind",
                config_class=ContractFakeDupConfig,
                capabilities=Capabilities(kind="training"),
            )
        ]


def test_a_plugin_declaring_an_unknown_kind_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = create_plugin_host(extra_plugins=[ContractFakeBadKind()])
    with pytest.raises(PluginError) as info:
        host.strategies()
    assert str(info.value) == (
        "plugin 'ContractFakeBadKind': Capabilities.kind must be 'train', 'infer' or "
        "'rollout', not 'training' (did you mean 'train'?)"
    )
    report = ErrorReport()  # and `posttrain validate` reports it
    build_workflow({"trainer": {"max_steps": 1}}, host, report, base_dir=str(tmp_path))
    assert [i.path for i in report.errors if "'training'" in i.message] == ["plugins"]
