"""A model named by hub id: ``validate`` warns when the local HF cache lacks it (no network);
``run`` ends with exit 2 and one line when neither the cache nor the hub has it, before the run
directory is made and without transformers' retries."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants  # a lazily loaded submodule: imported before it is patched
import pytest

from posttrain.cli import EXIT_OK, EXIT_USER, main

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
HUB_ID = "example-org/not-downloaded-model"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HF cache of this test's own."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_model(cache: Path, repo_id: str) -> None:
    """The layout huggingface_hub downloads into: refs/main names a snapshot holding the files."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


def test_validate_warns_about_a_hub_id_the_cache_lacks(hub_cache, capsys):
    args = ["validate", QUICKSTART, "--set", f"model_args.model_name_or_path={HUB_ID}"]
    assert main(args) == EXIT_OK
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("warning:")]
    assert f"model_args.model_name_or_path: '{HUB_ID}' is not a local directory" in line
    assert str(hub_cache) in line and f"hf download {HUB_ID}" in line
    assert "HF_HUB_OFFLINE=1" in line

    cache_model(hub_cache, HUB_ID)
    assert main(args) == EXIT_OK
    assert "warning:" not in capsys.readouterr().err


def test_validate_refuses_a_name_that_is_neither_a_path_nor_a_hub_id(hub_cache, capsys):
    args = ["validate", QUICKSTART, "--set", "model_args.model_name_or_path=org/bad name"]
    assert main(args) == EXIT_USER
    err = capsys.readouterr().err
    assert "'org/bad name' is neither a local path nor a hub id" in err, err


def test_run_with_a_hub_id_and_no_hub_is_one_line_and_leaves_no_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        # Port 9 (discard) on the loopback: refused at once, a hub that cannot be reached.
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
    }
    env.pop("HF_HUB_OFFLINE", None)
    start = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "posttrain.cli", "run", QUICKSTART),
            *("--set", f"model_args.model_name_or_path={HUB_ID}"),
            *("--set", f"trainer.output_dir={run_dir}"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == EXIT_USER, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    [line] = lines
    assert line.startswith("error: model_args.model_name_or_path: ")
    assert HUB_ID in line and "not in the HF cache" in line
    assert "http://127.0.0.1:9 cannot be reached" in line
    assert f"hf download {HUB_ID}" in line and "HF_HUB_OFFLINE=1" in line
    assert not run_dir.exists()
    assert "run directory" not in done.stdout
    # One request, no retries (transformers' took about 50 s): the start of the CLI dominates.
    assert elapsed < 60, elapsed


def test_run_offline_names_the_cache_and_the_variable(hub_cache, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run_dir = tmp_path / "run"
    args = ["run", QUICKSTART, "--set", f"model_args.model_name_or_path={HUB_ID}"]
    assert main([*args, "--set", f"trainer.output_dir={run_dir}"]) == EXIT_USER
    err = capsys.readouterr().err
    assert "and HF_HUB_OFFLINE is set" in err and str(hub_cache) in err, err
    assert not run_dir.exists()


class RepoNotFound(http.server.BaseHTTPRequestHandler):
    """A hub that has no model at all: what it answers an unknown (mistyped) id."""

    def do_GET(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass  # the test's output stays the CLI's


def test_a_mistyped_hub_id_says_the_hub_has_no_such_model(hub_cache, monkeypatch, tmp_path, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RepoNotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        run_dir = tmp_path / "run"
        typo = "model_args.model_name_or_path=Qwen/Qwen2.5-0.5B-Instrut"
        args = ["run", QUICKSTART, "--set", typo]
        assert main([*args, "--set", f"trainer.output_dir={run_dir}"]) == EXIT_USER
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert f"{endpoint} has no such model: check the name for a typo" in err, err
    assert "Traceback" not in err and not run_dir.exists()
