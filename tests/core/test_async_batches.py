"""The asynchronous batch source's bookkeeping (see posttrain.rollout.batches): batches come in
step order, each exactly ``max_staleness`` policy versions old whatever the timing, weight syncs
happen between generations, what was made ahead survives a checkpoint, and a producer's failure
reaches the loop."""

from __future__ import annotations

import json
import threading
import time

import attrs
import pytest
import torch

from posttrain.protocol import RolloutSamples
from posttrain.rollout.ahead import batch_from_record, batch_record
from posttrain.rollout.batches import AsyncBatches, ProducedBatch, SynchronousBatches
from posttrain.rollout.groups import ScoredGroups
from posttrain.tasks.data import Prompt
from posttrain.trainer.phase_timer import PhaseTimer


class Recorder:
    """Produces a stand-in batch per step (the scored groups are not looked at here) and
    records the steps it generated for."""

    def __init__(self, batches: list, fail_at: int | None = None, seconds: float = 0.0):
        self.batches = batches
        self.generating = threading.Event()
        self.fail_at = fail_at
        self.seconds = seconds  # each generation's

    def __call__(self, index, timer):
        with timer.phase("rollout"):
            self.generating.set()
            time.sleep(self.seconds)
            if index == self.fail_at:
                raise ValueError(f"engine failed at step {index}")
            self.batches.append(index)
            self.generating.clear()
        return f"batch {index}", {}, {"position": index}


def timer():
    return PhaseTimer(console=None, total_steps=0, start_step=0, show=False)


@pytest.mark.parametrize(("max_staleness", "seconds"), [(1, 0.0), (2, 0.0), (1, 0.05), (2, 0.05)])
def test_batches_in_order_exactly_max_staleness_behind(max_staleness, seconds):
    """A fast producer waits for the syncs, a slow one (``seconds``) is waited for: the policy
    that samples each batch is the same either way."""
    produced: list = []
    recorder = Recorder(produced, seconds=seconds)
    source = AsyncBatches(recorder, 0, max_staleness, first=1, last=6, make_timer=timer)
    syncs = []
    try:
        for step in range(1, 7):
            batch = source.next(step, timer())
            assert batch.index == step and batch.sampler_state == {"position": step}
            assert batch.policy_version == max(0, step - 1 - max_staleness)
            assert "async/rollout_s" in batch.timings

            def sync():
                # The engine is never generating while its weights change.
                syncs.append(recorder.generating.is_set())
                return {"bytes": 1}

            assert source.sync_weights(sync, version=step) == {"bytes": 1}
    finally:
        source.close()
    assert produced == [1, 2, 3, 4, 5, 6]
    assert syncs == [False] * 6


def test_a_producer_failure_reaches_the_loop():
    recorder = Recorder([], fail_at=2)
    source = AsyncBatches(recorder, 0, 1, first=1, last=4, make_timer=timer)
    try:
        source.next(1, timer())
        source.sync_weights(dict, version=1)
        with pytest.raises(ValueError, match="engine failed at step 2"):
            source.next(2, timer())
    finally:
        source.close()


def scored_batch(index: int) -> ProducedBatch:
    samples = RolloutSamples(
        prompt_ids=[[1, 2], [1, 2]],
        response_ids=[[3], [4, 5]],
        response_logprobs=[[-0.1], [-1 / 3, -2.0]],
        policy_versions=[[index - 2], [index - 2, index - 1]],
    )
    scored = ScoredGroups(
        prompts=[Prompt(text="1+1=", answer="2", ids=(1, 2))],
        samples=samples,
        rewards=torch.tensor([0.1, 1 / 3]),
        reward_metrics={"reward/rule": 0.7},
    )
    return ProducedBatch(index, scored, {"sampling/rounds": 1.0}, {"position": index}, index - 2)


def test_a_batch_made_ahead_reads_back_exactly():
    batch = scored_batch(4)
    back = batch_from_record(json.loads(json.dumps(batch_record(batch))))
    assert back.scored.rewards.dtype == torch.float32
    assert torch.equal(back.scored.rewards, batch.scored.rewards)
    for name in ("prompts", "samples", "reward_metrics", "turn_rewards"):
        assert getattr(back.scored, name) == getattr(batch.scored, name), name
    assert attrs.evolve(back, scored=None) == attrs.evolve(batch, scored=None)


def test_a_batch_made_ahead_keeps_its_routing_bitwise():
    """MoE routing replay: each sample's experts ([tokens, layers, k], uint8) survive the
    checkpoint's JSON, so a resumed run replays what the rollout chose."""
    batch = scored_batch(4)
    routing = [torch.randint(0, 128, (3, 2, 8), dtype=torch.uint8) for _ in range(2)]
    batch.scored.samples = attrs.evolve(batch.scored.samples, routing=routing)
    back = batch_from_record(json.loads(json.dumps(batch_record(batch))))
    assert back.scored.samples.routing is not None
    for got, sent in zip(back.scored.samples.routing, routing, strict=True):
        assert got.dtype == torch.uint8 and torch.equal(got, sent)
    assert attrs.evolve(back.scored.samples, routing=None) == attrs.evolve(
        batch.scored.samples, routing=None
    )


@pytest.mark.parametrize("asynchronous", [True, False])
def test_batches_kept_by_a_checkpoint_come_first_then_the_producer_goes_on(asynchronous):
    """A run that resumes at step 2 with the batches of steps 3 and 4 made ahead."""
    produced: list = []
    ahead = [scored_batch(3), scored_batch(4)]
    if asynchronous:
        source = AsyncBatches(
            Recorder(produced), 2, 2, first=3, last=6, make_timer=timer, ahead=ahead
        )
    else:
        source = SynchronousBatches(Recorder(produced), 2, ahead)
    try:
        assert [b.index for b in source.ahead()][:2] == [3, 4]  # (5 may be made already)
        got = [source.next(3, timer()), source.next(4, timer())]
        assert got == ahead
        for step in (3, 4, 5, 6):
            if step > 4:
                assert source.next(step, timer()).sampler_state == {"position": step}
            source.sync_weights(dict, version=step)
    finally:
        source.close()
    assert produced == [5, 6]  # nothing drawn twice


def test_a_checkpoint_after_a_sync_finds_every_batch_the_old_policy_samples():
    produced: list = []
    source = AsyncBatches(Recorder(produced, seconds=0.02), 0, 2, first=1, last=8, make_timer=timer)
    try:
        for step in (1, 2, 3):
            source.next(step, timer())
            source.sync_weights(dict, version=step)
            made = [b.index for b in source.ahead()]
            # the batches of steps step+1 .. step+2, sampled before this step's update
            assert made[:2] == [step + 1, step + 2], made
            versions = [b.policy_version for b in source.ahead()][:2]
            assert versions == [max(0, i - 3) for i in (step + 1, step + 2)]
    finally:
        source.close()


def test_a_step_without_an_update_moves_the_schedule_on():
    """A critic's warm-up: no weights change, the producer is not held back."""
    source = AsyncBatches(Recorder([]), 0, 1, first=1, last=4, make_timer=timer)
    try:
        for step in (1, 2, 3, 4):
            assert source.next(step, timer()).policy_version == 0
            assert source.sync_weights(None, version=step) == {}
    finally:
        source.close()


class Jittery:
    """A producer whose generations take a random few milliseconds: the timing changes from run
    to run, the schedule must not."""

    def __init__(self, seed: int):
        import random

        self.rng = random.Random(seed)

    def __call__(self, index, timer):
        time.sleep(self.rng.random() * 0.003)
        return f"batch {index}", {}, {"position": index}


def trained(max_staleness, steps, save_every, seed, kill_after=None, resume=None):
    """The loop's use of an AsyncBatches: each step takes its batch, syncs, and every
    ``save_every`` steps checkpoints what was made ahead. ``kill_after``: the run dies right
    after that step (before its checkpoint, if it had one). ``resume``: ``(step, ahead)`` of a
    checkpoint to start from. Returns what each step trained on and the checkpoints."""
    start, ahead = resume or (0, [])
    source = AsyncBatches(
        Jittery(seed),
        start,
        max_staleness,
        first=start + 1,
        last=steps,
        make_timer=timer,
        ahead=ahead,
    )
    seen, checkpoints = {}, {}
    try:
        for step in range(start + 1, steps + 1):
            batch = source.next(step, timer())
            seen[step] = (batch.index, batch.policy_version, batch.sampler_state["position"])
            source.sync_weights(dict, version=step)
            if step == kill_after:
                break
            if step % save_every == 0:
                checkpoints[step] = list(source.ahead())
    finally:
        source.close()
    return seen, checkpoints


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_run_killed_at_any_step_resumes_to_the_same_batches(max_staleness):
    """24 kill points a staleness (after each step of a 24-step run that checkpoints every 3):
    the rerun from the latest checkpoint trains on the same batch, sampled by the same policy,
    at every step, as the uninterrupted run."""
    steps, every = 24, 3
    uninterrupted, _ = trained(max_staleness, steps, every, seed=0)
    assert uninterrupted == {s: (s, max(0, s - 1 - max_staleness), s) for s in range(1, 25)}
    for kill_after in range(1, steps + 1):
        before, checkpoints = trained(
            max_staleness, steps, every, seed=kill_after, kill_after=kill_after
        )
        saved = max(checkpoints, default=0)
        resumed, _ = trained(
            max_staleness,
            steps,
            every,
            seed=-kill_after,
            resume=(saved, checkpoints.get(saved, [])),
        )
        run = {s: v for s, v in before.items() if s <= saved} | resumed
        assert run == uninterrupted, kill_after
