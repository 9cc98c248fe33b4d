"""The conformance kit's own tests: each deliberately broken trainer of broken_trainers.py fails
the kit's test that must catch it, with a message naming its bug. The correct trainer they are
made from (the example's ``ddp_train``) passes the whole kit in test_third_party_plugin.py."""

from __future__ import annotations

import os
import re

import pytest

from posttrain.testing import StrategyContract

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE_SRC = os.path.join(HERE, "..", "..", "examples", "third_party_plugin", "src")


@pytest.fixture(scope="module", autouse=True)
def importable_plugins():
    """The broken trainers and the example they wrap, importable here and in rank processes."""
    paths = [HERE, os.path.abspath(EXAMPLE_SRC)]
    with pytest.MonkeyPatch.context() as mp:
        for path in paths:
            mp.syspath_prepend(path)
        mp.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
        yield


def fails_naming(test, *args, match: str) -> None:
    """Run the kit's ``test``; it must fail, with a message matching ``match``."""
    with pytest.raises((pytest.fail.Exception, AssertionError)) as caught:
        test(*args)
    message = str(caught.value)
    assert re.search(match, message), f"the kit failed, but without naming the bug: {message}"


class BrokenTrainerContract(StrategyContract):
    """The kit on a broken trainer, every test off; each subclass runs the one that must catch
    its bug."""

    world_size = 2
    plugins = ("broken_trainers:dispatching", "broken_trainers:no_memory")


for _name in [n for n in dir(StrategyContract) if n.startswith("test_")]:
    setattr(BrokenTrainerContract, _name, None)


class TestKitCatchesGradientsNotAllReduced(BrokenTrainerContract):
    strategy = "broken_no_allreduce"

    def test_train_then_sync_to_hf_infer_logprob_parity(self, spec_and_config, start):
        fails_naming(
            StrategyContract.test_train_then_sync_to_hf_infer_logprob_parity,
            self,
            spec_and_config,
            start,
            match=r"data-parallel rank 1's log-probs .* drifted apart .*all-reduced",
        )


class BrokenResumeContract(BrokenTrainerContract):
    """The kit's resume contract on a trainer that loses some state at load: it must fail
    with ``message`` (a pattern)."""

    message = ""

    def test_checkpoint_round_trip_is_exact(
        self, spec_and_config, start, tmp_path, tiny_model_path
    ):
        fails_naming(
            StrategyContract.test_checkpoint_round_trip_is_exact,
            self,
            spec_and_config,
            start,
            tmp_path,
            tiny_model_path,
            match=self.message,
        )


class TestKitCatchesSchedulerNotRestored(BrokenResumeContract):
    strategy = "broken_scheduler_not_restored"
    message = r"actor/lr at step 3 .*: 0\.0, expected 0\.01: the learning-rate scheduler"


class TestKitCatchesOptimizerNotRestored(BrokenResumeContract):
    strategy = "broken_optimizer_not_restored"
    message = r"weights after step 3 .* the optimizer state .* is not saved and restored"


class TestKitCatchesRankZeroOnlyExport(BrokenTrainerContract):
    strategy = "broken_rank0_only_export"

    def test_export_weights_equal_loaded_checkpoint(self, spec_and_config, start, tiny_model_path):
        fails_naming(
            StrategyContract.test_export_weights_equal_loaded_checkpoint,
            self,
            spec_and_config,
            start,
            tiny_model_path,
            match=r"rank\(s\) \[1\] ended after 0 bucket\(s\) .* every rank must yield",
        )


class TestKitCatchesMissingMemoryAndShutdownHooks(BrokenTrainerContract):
    strategy = "broken_no_memory_hooks"

    def test_declared_capabilities_match_implemented_hooks(self, spec_and_config, request):
        for missing in ("release_memory", "resume_memory", "shutdown_worker"):
            fails_naming(
                StrategyContract.test_declared_capabilities_match_implemented_hooks,
                self,
                spec_and_config,
                request,
                match=rf"broken_no_memory_hooks implements no {missing} .* every strategy",
            )
