"""EngineHooks: one naming rule for every worker hook, and a warning at registration for an
engine function that the rule never reaches."""

from __future__ import annotations

import inspect
import sys
import textwrap
import types
import warnings
from types import SimpleNamespace

import pytest

from posttrain.errors import PluginWarning
from posttrain.host.engine_hooks import ENGINE_FUNCTIONS, EngineHooks, misnamed_engine_functions
from posttrain.host.plugin_host import create_plugin_host


def test_every_worker_hook_calls_the_engine_function_of_its_name(monkeypatch):
    called = []
    engine = types.ModuleType("contract_recording_engine")

    def __getattr__(name):
        return lambda worker, *args: called.append(name) or name

    engine.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, engine.__name__, engine)

    class Plugin(EngineHooks):
        strategies = ("mine",)
        engine = "contract_recording_engine"

    plugin = Plugin()
    hooks = [name for name in dir(EngineHooks) if name.startswith("posttrain_")]
    assert sorted(h.removeprefix("posttrain_") for h in hooks) == sorted(ENGINE_FUNCTIONS)
    for hook in hooks:
        method = getattr(plugin, hook)
        others = [None] * (len(inspect.signature(method).parameters) - 1)
        assert method(SimpleNamespace(strategy_name="mine"), *others) == hook[len("posttrain_") :]
        assert method(SimpleNamespace(strategy_name="other"), *others) is None
    assert "shutdown_worker" in called


def _engine_plugin(tmp_path, monkeypatch, module: str, source: str, package_init: str = ""):
    """An EngineHooks plugin whose engine module ``module`` (a dotted name makes the packages)
    is written to tmp_path with ``source``."""
    *packages, leaf = module.split(".")
    folder = tmp_path
    for package in packages:
        folder = folder / package
        folder.mkdir()
        (folder / "__init__.py").write_text(package_init)
    (folder / f"{leaf}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")

    class MisnamedPlugin(EngineHooks):
        strategies = ("contract_misnamed",)
        engine = module

    return MisnamedPlugin()


MISNAMED_ENGINE = """\
    import os.path
    from os.path import join as load_chekpoint

    raise RuntimeError("the engine module must not be imported at registration")


    def setup_parallel(worker):
        return {"dp_rank": 0, "dp_size": 1}


    def shutdown(worker):
        return True


    def posttrain_generate(worker, request):
        return None


    def compute_logprob(worker, batch):
        return None


    def plan_micro_batches(batch):
        return [batch]


    def _shutdown(worker):
        return True
"""


def test_registration_warns_of_misnamed_engine_functions_without_importing(tmp_path, monkeypatch):
    plugin = _engine_plugin(tmp_path, monkeypatch, "contract_misnamed_engine", MISNAMED_ENGINE)
    with pytest.warns(PluginWarning) as caught:
        create_plugin_host(extra_plugins=[plugin])
    messages = sorted(str(w.message) for w in caught if w.category is PluginWarning)
    assert len(messages) == 4, messages
    prefix = "plugin 'MisnamedPlugin': contract_misnamed_engine."
    assert messages[0].startswith(f"{prefix}compute_logprob is never called")
    assert messages[0].endswith("name it compute_logprobs")
    assert messages[1].endswith(
        "load_chekpoint is never called (EngineHooks calls the engine "
        "function named after each worker hook, posttrain_X -> X); "
        "name it load_checkpoint"
    )
    assert messages[2].startswith(f"{prefix}posttrain_generate ") and messages[2].endswith(
        "name it generate"
    )
    assert messages[3].startswith(f"{prefix}shutdown ")
    assert messages[3].endswith("name it shutdown_worker")
    assert "contract_misnamed_engine" not in sys.modules


def test_the_engine_packages_are_not_imported_either(tmp_path, monkeypatch):
    """find_spec would run the packages' __init__, which in a real plugin may import the
    engine: the module is looked up on the file system."""
    plugin = _engine_plugin(
        tmp_path,
        monkeypatch,
        "contract_engine_pkg.sub.engine",
        "def shutdown(worker):\n    return True\n",
        package_init="raise RuntimeError('package imported at registration')\n",
    )
    assert misnamed_engine_functions(plugin) == [("shutdown", "shutdown_worker")]
    assert "contract_engine_pkg" not in sys.modules


def test_an_engine_without_readable_source_is_not_judged(monkeypatch):
    monkeypatch.setitem(sys.modules, "contract_sourceless_engine", types.ModuleType("x"))

    class Plugin(EngineHooks):
        strategies = ("mine",)
        engine = "contract_sourceless_engine"

    assert misnamed_engine_functions(Plugin()) == []


def test_the_installed_engines_are_named_as_engine_hooks_calls_them():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        host = create_plugin_host()
    engines = [p for p in host.pm.get_plugins() if isinstance(p, EngineHooks)]
    assert any(p.engine == "posttrain_hf_infer.engine" for p in engines)
    assert all(misnamed_engine_functions(p) == [] for p in engines)


def test_the_cli_shows_plugin_warnings_as_its_own(monkeypatch, capsys):
    import posttrain.host.plugin_host
    from posttrain.cli import main

    real = posttrain.host.plugin_host.create_plugin_host

    def warning_host():
        warnings.warn(
            "plugin 'x': engine.shutdown is never called [sic]", PluginWarning, stacklevel=1
        )
        return real()

    monkeypatch.setattr(posttrain.host.plugin_host, "create_plugin_host", warning_host)
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    assert main(["plugins", "--json"]) == 0
    err = capsys.readouterr().err
    assert "warning: plugin 'x': engine.shutdown is never called [sic]" in err
    assert "PluginWarning" not in err
