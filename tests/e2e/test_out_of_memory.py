"""A rank out of GPU memory is the user's error: exit 2, no traceback on the console, the role
and the call named, the settings that would shrink the role, and how a rerun resumes."""

from __future__ import annotations

import pytest
from conftest import run_env, run_quickstart, small_run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_out_of_memory_in_a_rank_is_a_user_error(tmp_path, e2e_cache):
    proc = run_quickstart(
        tmp_path / "run",
        *small_run(max_steps=4, save_steps=1),
        "--set",
        "plugins=[oom_plugin]",
        check=False,
        env=run_env(POSTTRAIN_TEST_OOM_AT_STEP="3"),
    )
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "actor_train ran out of GPU memory in train_step" in err
    assert "Tried to allocate 3.99 GiB" in err
    assert "what would shrink it:" in err
    assert "actor_train.model_args.disable_gradient_checkpointing: false" in err
    assert "the run stopped" in err and "step 2" in err
