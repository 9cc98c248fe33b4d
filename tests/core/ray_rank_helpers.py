"""Rank-side helpers of the ray launcher tests, called through ``run_function``."""

import os


def rank_env(runtime):
    print(f"rank_env called on rank {runtime.ctx.rank}", flush=True)
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PT_TEST_VAR")
    return {k: os.environ.get(k) for k in keys}


def boom(runtime):
    print("about to fail", flush=True)
    raise ValueError("boom")


def die(runtime):
    print("about to exit", flush=True)
    os._exit(3)
