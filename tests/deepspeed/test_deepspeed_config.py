"""posttrain validate for deepspeed roles (no torch, no deepspeed import), doctor, and the
refusals of what DeepSpeed's CPU accelerator cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.testing import StrategyContract

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart_deepspeed.yaml"


def test_validate_reports_every_error_at_once_without_importing_torch(tmp_path):
    workflow = yaml.safe_load(QUICKSTART.read_text())
    workflow["actor_train"]["strategy_args"]["strategy_config"] = {
        "zero_stage": 1,
        "offload_param": True,
        "overlap_comm": True,
        "ds_config": {
            "zero_optimizaton": {},
            "gradient_clipping": 0.5,
            "communication_data_type": "fp32",  # a real DeepSpeed key: accepted
            "zero_optimization": {
                "overlap_com": True,
                "stage": 3,
                "stage3_gather_16bit_weights_on_model_save": True,  # accepted
            },
        },
    }
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(workflow))
    code = (
        "import sys; from posttrain.cli import main;"
        f"rc = main(['validate', {str(path)!r}]);"
        "print('IMPORTED', 'torch' in sys.modules, 'deepspeed' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    where = "actor_train.strategy_args.strategy_config"
    expected = [
        (f"{where}.offload_param", "needs zero_stage 3"),
        (f"{where}.overlap_comm", "only at ZeRO-2/3"),
        (f"{where}.ds_config.zero_optimizaton", "did you mean 'zero_optimization'"),
        (f"{where}.ds_config.gradient_clipping", "training_args.max_grad_norm"),
        (f"{where}.ds_config.zero_optimization.overlap_com", "did you mean 'overlap_comm'"),
        (f"{where}.ds_config.zero_optimization.stage", "strategy_config.zero_stage"),
    ]
    for path_, message in expected:
        line = next((ln for ln in out.splitlines() if path_ + ":" in ln), "")
        assert message in line, (path_, out)
    assert "6 error(s)" in out, out
    assert "IMPORTED False False" in out


def test_unknown_strategy_config_key_suggests_the_field(tmp_path):
    workflow = yaml.safe_load(QUICKSTART.read_text())
    workflow["actor_train"]["strategy_args"]["strategy_config"] = {"zero_stag": 3}
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(workflow))
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "strategy_config.zero_stag: unknown key (did you mean 'zero_stage'?)" in out


def test_doctor_reports_the_deepspeed_range():
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},  # rich would truncate the package names
    )
    out = proc.stdout + proc.stderr
    from importlib.metadata import version

    line = next((ln for ln in out.splitlines() if "posttrain-deepspeed" in ln), "")
    cells = [c.strip() for c in line.split("│")[1:-1]]
    assert cells == ["posttrain-deepspeed", "deepspeed", version("deepspeed"), ">=0.16,<0.20", "ok"]


def test_fp16_on_cpu_is_refused_with_a_clear_message():
    from types import SimpleNamespace

    from posttrain.config.sections import ModelArgs
    from posttrain.errors import UserError
    from posttrain_deepspeed import engine
    from posttrain_deepspeed.config import DeepSpeedTrainConfig

    worker = SimpleNamespace(
        device="cpu",
        role="actor_train",
        strategy_name="deepspeed_train",
        model_args=ModelArgs(model_name_or_path="preset:tiny-qwen2", dtype="fp16"),
        config=DeepSpeedTrainConfig(),
    )
    with pytest.raises(UserError, match=r"fp16 needs a GPU.*use bf16 or fp32 on CPU"):
        engine._refuse_on_cpu(worker)


class TestDeepSpeedRefusesAtStart:
    """A ds_config value only DeepSpeed can judge (validation checks keys, not values) fails the
    role's start with DeepSpeed's own complaint, the role and the config it was given."""

    strategy = "deepspeed_train"
    strategy_config = {"ds_config": {"zero_optimization": {"reduce_scatter": "sometimes"}}}
    world_size = 1
    group_timeout_s = 120.0
    device = "cpu"
    lora = StrategyContract.lora
    plugins = StrategyContract.plugins
    spec_and_config = StrategyContract.spec_and_config
    start = StrategyContract.start
    group_spec = classmethod(StrategyContract.group_spec.__func__)

    @pytest.mark.slow
    @pytest.mark.timeout(180)
    def test_bad_ds_config_value_is_a_clear_error(self, start):
        from posttrain.errors import WorkerError

        with pytest.raises(WorkerError) as caught:
            start()
        message = str(caught.value)
        assert "UserError: role actor_train: DeepSpeed refused the config" in message, message
        assert "Input should be a valid boolean" in message, message
        assert "reduce_scatter" in message and '"stage": 2' in message, message


@pytest.mark.parametrize("plugins_loaded", [True, False], ids=["plugins", "bare"])
def test_an_import_of_deepspeed_by_another_library_does_not_warn_in_a_run(plugins_loaded):
    """accelerate imports deepspeed in every save_pretrained (a preset's build, an export), in
    runs of any strategy; without CUDA, DeepSpeed's first import warns that it guessed the CPU
    accelerator. Every posttrain process loads the plugins first, which keep that line out."""
    load = "from posttrain.host.plugin_host import create_plugin_host; create_plugin_host(); "
    code = (load if plugins_loaded else "") + "import deepspeed"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU: DeepSpeed guesses the CPU
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    guessed = "Setting accelerator to CPU" in proc.stdout + proc.stderr
    # Bare, the warning shows: the test would catch a DeepSpeed that no longer logs it so.
    assert guessed == (not plugins_loaded), proc.stdout + proc.stderr
