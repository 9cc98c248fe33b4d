"""The README's commands, in the README's order, in a fresh directory, as a newcomer types them.

Command 1 (the quickstart) must learn; every later command must leave the runs before it usable:
a rerun of command 1 changes nothing, the asynchronous run writes its own directory, and after
all of them ``posttrain export-hf`` works on every checkpoint of every run, giving a directory
that transformers loads and tokenizes as training did.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
from conftest import REPO, posttrain_cmd, read_metrics, run_env

# Commands of the README that this test does not run, and why: the pip installs are what set
# this environment up, the test suite is what runs this test, and the other examples have tests
# of their own, which the README names beside each: tests/megatron, tests/deepspeed, tests/vllm,
# tests/sglang, tests/e2e/test_lora.py, tests/e2e/test_algorithms_e2e.py (PPO),
# tests/e2e/test_calculator_example.py and tests/e2e/test_python_tool_example.py.
NOT_HERE = (
    "pip ",
    "python -m pytest",
    "bash .ci/",
    ".venv-",
    "quickstart_megatron",
    "quickstart_deepspeed",
    "quickstart_lora",
    "quickstart_ppo",
    "calculator_tool",
    "python_tool",
)
# Each example the README runs elsewhere, and the test that runs it.
OWN_TESTS = {
    "quickstart_megatron": "tests/megatron/test_megatron_quickstart.py",
    "quickstart_deepspeed": "tests/deepspeed/test_deepspeed_quickstart.py",
    "quickstart_lora": "tests/e2e/test_lora.py",
    "quickstart_ppo": "tests/e2e/test_algorithms_e2e.py",
    "calculator_tool": "tests/e2e/test_calculator_example.py",
    "python_tool": "tests/e2e/test_python_tool_example.py",
}
# The asynchronous runs train for the quickstart's 400 steps; 20 show the same, and 10 without
# checkpoints show partial rollouts run (the plain asynchronous run's checkpoints are exported).
SHORTER = {
    "quickstart_async": ("--set", "trainer.max_steps=20", "--set", "trainer.save_steps=10"),
    "quickstart_partial": (
        *("--set", "trainer.max_steps=10", "--set", "trainer.save_steps=0"),
        *("--set", "trainer.save_final=false"),
    ),
}


def readme_commands() -> list[list[str]]:
    """The ``posttrain`` commands of the README's bash blocks, in order."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in (p.strip() for p in line.split("&&")):
                if part.startswith("posttrain ") and not any(n in part for n in NOT_HERE):
                    commands.append(shlex.split(part))
    return commands


def _tree(path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_commands_in_order_then_every_checkpoint_exports(tmp_path, e2e_cache):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    commands = readme_commands()
    assert commands[0] == ["posttrain", "run", "examples/quickstart.yaml"]
    assert any("export-hf" in c for c in commands), "the README shows an export"
    runs = tmp_path / "runs"
    quickstart = runs / "quickstart"
    for command in [*commands[:1], *commands]:  # command 1 twice: the rerun trains nothing
        extra = next((v for k, v in SHORTER.items() if any(k in a for a in command)), ())
        before = _tree(quickstart) if quickstart.exists() else {}
        proc = subprocess.run(
            posttrain_cmd(*command[1:], *extra),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=run_env(),
            timeout=600,
        )
        assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
        if before and command[1] == "run":
            # Another run (or this one again) never touches the quickstart's directory.
            assert _tree(quickstart) == before, command
        if before and command == commands[0]:
            assert "nothing to run" in proc.stdout
        if any("quickstart_partial" in a for a in command):
            # The README's claim: samples span a weight sync on most steps, not on a few early
            # ones (every step after the first, where it was measured).
            fracs = [m["rollout/partial_frac"] for m in read_metrics(runs / "quickstart_partial")]
            assert sum(f > 0 for f in fracs[1:]) > len(fracs[1:]) / 2, fracs
        if command == commands[0] and not before:
            rewards = [m["reward/mean"] for m in read_metrics(quickstart)]
            assert len(rewards) == 400
            assert sum(rewards[:5]) / 5 < 0.2, "the tiny model should start near chance"
            assert sum(rewards[-10:]) / 10 >= 0.8
            assert (quickstart / "curves.png").stat().st_size > 10_000
    checkpoints = sorted(runs.glob("*/checkpoint-*"))
    assert {c.parent.name for c in checkpoints} == {"quickstart", "quickstart_async"}
    assert len(checkpoints) == 6
    for checkpoint in checkpoints:  # each exports from its own record
        out = tmp_path / "exported" / f"{checkpoint.parent.name}-{checkpoint.name}"
        proc = subprocess.run(
            posttrain_cmd("export-hf", str(checkpoint), str(out)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=run_env(),
            timeout=300,
        )
        assert proc.returncode == 0, (checkpoint, proc.stdout[-2000:], proc.stderr[-2000:])
    _check_export_loads_as_trained(quickstart, tmp_path / "exported" / "quickstart-checkpoint-400")


def _check_export_loads_as_trained(run_dir, exported) -> None:
    """transformers loads the export; its tokenizer encodes as training's, and every file is
    as readable as a new file here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.backends.models import load_tokenizer
    from posttrain.config.sections import ModelArgs

    text = " 3 + 4 ="
    trained = load_tokenizer(ModelArgs(model_name_or_path="preset:tiny-qwen2"))
    loaded = AutoTokenizer.from_pretrained(str(exported))
    assert loaded(text)["input_ids"] == trained(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(exported))
    with torch.no_grad():
        logits = model(torch.tensor([trained("3+4=")["input_ids"]])).logits
    assert torch.isfinite(logits).all()
    modes = {p.name: p.stat().st_mode & 0o777 for p in exported.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_every_example_the_readme_shows_has_a_test_that_runs_it():
    """The README's ``posttrain run examples/X.yaml`` commands that the test above leaves out
    are each run by the test named in OWN_TESTS (and named beside the command in the README)."""
    text = (REPO / "README.md").read_text()
    shown = set(re.findall(r"posttrain run examples/(\w+)\.yaml", text)) - {"quickstart"}
    assert shown, "the README shows the other examples"
    for name in sorted(shown):
        assert name in OWN_TESTS, f"examples/{name}.yaml: name the test that runs it"
        test = OWN_TESTS[name]
        assert test in text, f"the README does not name {test} beside examples/{name}.yaml"
        assert name in (REPO / test).read_text(), f"{test} does not run examples/{name}.yaml"


def test_the_quick_subset_the_readme_names_exists():
    """Command 2's comment names ``python -m pytest -m quick``: the marker is registered and
    marks tests of the core, the docs' examples and the conformance kit."""
    text = (REPO / "README.md").read_text()
    assert "python -m pytest -m quick" in text
    assert '"quick: ' in (REPO / "pyproject.toml").read_text()
    marked = {
        p.name for p in (REPO / "tests").rglob("test_*.py") if "pytest.mark.quick" in p.read_text()
    }
    assert {
        "test_config_validation.py",
        "test_docs_examples.py",
        "test_hf_infer_contract.py",
    } <= marked
