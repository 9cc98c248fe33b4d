"""Shared helper for plugin-installation tests: a throwaway virtual environment.

The venv sees the running interpreter's site-packages (posttrain, pluggy, setuptools, pip) through
a ``.pth`` file, whether the tests run from a venv or not, so installing a plugin into it takes
seconds, needs no network, and leaves the test machine's environment alone.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Variables that change which plugins load: never inherited by the subprocesses.
PLUGIN_ENV = ("POSTTRAIN_PLUGINS", "POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD")


def build_plugin_venv(root: Path, *packages: Path) -> Path:
    """Create ``root/venv`` and install ``packages`` (source dirs) into it; return its python.

    Each package is copied first, so the build leaves no ``build/`` or ``*.egg-info`` behind in
    the repository.
    """
    venv = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        capture_output=True,
        text=True,
    )
    python = venv / "bin" / "python"
    _inherit_site_packages(python)
    for package in packages:
        copy = root / "src" / package.name
        shutil.copytree(
            package, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
        )
        proc = subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--disable-pip-version-check",
                "--quiet",
                str(copy),
            ],
            capture_output=True,
            text=True,
            env=clean_env(),
            cwd=root,
        )
        assert proc.returncode == 0, f"pip install {package} failed:\n{proc.stdout}\n{proc.stderr}"
    (root / "work").mkdir(exist_ok=True)
    return python


def _inherit_site_packages(python: Path) -> None:
    """Make the running interpreter's site dirs (and their .pth files) visible in the venv.

    ``--system-site-packages`` would expose the *base* interpreter's packages, which lack
    posttrain when the tests themselves run inside a virtual environment (as in CI)."""
    target = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dirs = [d for d in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(d)]
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
    Path(target, "_posttrain_parent_site.pth").write_text("\n".join(lines) + "\n")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    env["COLUMNS"] = "400"  # rich tables: no wrapping inside cells
    env.update(extra)
    return env


def run_in_venv(
    python: Path, args: list[str], cwd: Path, **env: str
) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in ``cwd`` (outside the repository) with a clean plugin environment."""
    return subprocess.run(
        [str(python), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(**env),
        timeout=240,
    )
