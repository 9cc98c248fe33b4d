"""What plugins add to a run through hooks: files in each checkpoint (checksummed, handed back,
checked for clashes) and metrics of each step (checked, never overriding the core's)."""

from __future__ import annotations

import os
import re

import pytest

from posttrain import hookimpl
from posttrain.checkpoint import manager, plugin_files
from posttrain.checkpoint.manifest import verify
from posttrain.errors import CheckpointError, PluginError
from posttrain.host.plugin_host import create_plugin_host
from posttrain.trainer.plugin_metrics import contributed_metrics


class Files:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def posttrain_checkpoint_files(self, step, run_dir):
        return self.answer


class Metrics:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def posttrain_step_metrics(self, step, metrics):
        return self.answer


def host_with(*plugins):
    host = create_plugin_host()
    for index, plugin in enumerate(plugins):
        host.pm.register(plugin, name=f"third{index}")
    return host


def test_contributed_files_are_listed_verified_and_handed_back(tmp_path):
    host = host_with(Files({"third0/state.json": b'{"n": 1}'}), Files({"third1/a/b.bin": b"\0"}))
    files = plugin_files.collect(host, 3, str(tmp_path))
    tmp = manager.temp_dir(str(tmp_path), 3)
    known = plugin_files.write(tmp, files)
    path, manifest = manager.finalize_checkpoint(str(tmp_path), 3, tmp, {}, {}, known=known)
    assert set(verify(path).files) == {
        "plugin_files/third0/state.json",
        "plugin_files/third1/a/b.bin",
    }
    assert plugin_files.read(path, manifest.files) == files

    with open(os.path.join(path, "plugin_files", "third0", "state.json"), "wb") as f:
        f.write(b'{"n": 2}')
    with pytest.raises(
        CheckpointError, match=re.escape("plugin_files/third0/state.json is corrupted")
    ):
        verify(path)


def test_a_file_added_to_a_complete_checkpoint_makes_it_refused(tmp_path):
    tmp = manager.temp_dir(str(tmp_path), 1)
    path, _ = manager.finalize_checkpoint(str(tmp_path), 1, tmp, {}, {})
    with open(os.path.join(path, "late.txt"), "w") as f:
        f.write("written after the manifest")
    with pytest.raises(
        CheckpointError, match=re.escape("late.txt is not listed in its manifest.json")
    ):
        verify(path)


@pytest.mark.parametrize(
    "answers, message",
    [
        (({"x/a": b"1"}, {"x/a": b"2"}), "contributed by two plugins: 'third0' and 'third1'"),
        (({"../escape": b"1"},), "must be a normalised relative path"),
        (({"/abs": b"1"},), "must be a normalised relative path"),
        (({"x/./a": b"1"},), "must be a normalised relative path"),
        (({"x/a": "text"},), "has content of type str; expected bytes"),
        ((["x/a"],), "returned list; expected a dict"),
    ],
)
def test_bad_checkpoint_files_name_the_plugin(tmp_path, answers, message):
    host = host_with(*(Files(a) for a in answers))
    with pytest.raises(PluginError, match=re.escape(message)):
        plugin_files.collect(host, 1, str(tmp_path))


def test_contributed_metrics_are_merged_and_checked():
    core = {"reward/mean": 0.5, "time/rollout": 1.0}
    host = host_with(Metrics({"third0/score": 3}), Metrics({"time/third1": 0.25}))
    assert contributed_metrics(host, 1, core) == {"third0/score": 3.0, "time/third1": 0.25}

    for answers, message in [
        (({"reward/mean": 1.0},), "metric 'reward/mean' is one the core reports"),
        (({"a": 1.0}, {"a": 2.0}), "metric 'a' is reported by two plugins"),
        (({"a": "1"},), "expected a real number"),
        (({"a": True},), "expected a real number"),
        ((3.0,), "expected a dict"),
    ]:
        host = host_with(*(Metrics(a) for a in answers))
        with pytest.raises(PluginError, match=message):
            contributed_metrics(host, 1, core)


def test_the_core_metrics_are_read_only_for_plugins():
    class Mutating:
        @hookimpl
        def posttrain_step_metrics(self, step, metrics):
            metrics["reward/mean"] = 1.0

    with pytest.raises(TypeError):
        contributed_metrics(host_with(Mutating()), 1, {"reward/mean": 0.5})
