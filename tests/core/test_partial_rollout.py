"""Partial rollouts (posttrain.rollout.partial) on the real engine (hf_infer in this process,
preset:tiny-qwen2 with seeded weights whose greedy samples end at various lengths): segments
sample what one call does, a weight swap between two segments shows in the tokens' versions
and in their behaviour log-probs, a waiting weight sync gets the engine between two segments,
and the workflow's mistakes are reported."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import attrs
import pytest
import torch

from posttrain.config.report import ErrorReport
from posttrain.loading.workflow import build_workflow
from posttrain.protocol import GenerationRequest, SamplingParams, WeightBucket
from posttrain.protocol import build_sequence_batch as batch_of
from posttrain.rollout.batches import AsyncBatches
from posttrain.rollout.partial import end_token_ids, generate_in_segments, version_metrics
from posttrain.testing.expected import perturbed_state, reference_logprobs
from posttrain.trainer.phase_timer import PhaseTimer
from posttrain_hf_infer.engine import HFInferState

PROMPTS = ["3+4=", "12+5=", "7="]
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
# Seeded weights (perturbed_state's noise at 0.3): with seed 3 greedy samples end with
# end-of-sequence after 8, 8 and 4 tokens; with seed 1 two run the full 12.
ENDS_EARLY, RUNS_LONG = 3, 1


@attrs.define
class TestPrompts:
    """The prompts' token ids, kept on the engine's worker by the module's fixture."""

    __test__ = False  # not a test class
    ids: list[list[int]] = attrs.Factory(list)


@pytest.fixture(scope="module")
def engine(hf_infer_worker, tiny_model_path):
    """The session's hf_infer engine, given seeded weights by the tests here: at the module's end
    it gets the preset's weights back (an exact copy), as the other tests expect them."""
    from safetensors.torch import load_file

    worker = hf_infer_worker
    tokenizer = worker.engine_state(HFInferState).tokenizer
    worker.engine_state(TestPrompts).ids = [tokenizer(t)["input_ids"] for t in PROMPTS]
    yield worker
    worker.engine_state(TestPrompts).ids = []
    load(worker, load_file(os.path.join(tiny_model_path, "model.safetensors")))


def load(worker, state: dict) -> None:
    from posttrain_hf_infer import engine as hf_infer

    hf_infer.import_weights(worker, [WeightBucket(list(state.items()))])


def generate_on(worker):
    from posttrain_hf_infer import engine as hf_infer

    def generate(prompt_ids, sampling, seed):
        request = GenerationRequest(prompt_ids=prompt_ids, sampling=sampling, seed=seed)
        return hf_infer.generate(worker, request)

    return generate


def turns(worker, swaps: dict[int, dict] | None = None):
    """An engine turn per segment; before segment ``k`` of ``swaps``, its weights are loaded
    (a weight sync) and the version goes up by one. Records each segment's version."""
    swaps = swaps or {}
    record: list[int] = []

    @contextlib.contextmanager
    def turn():
        index = len(record)
        if index in swaps:
            load(worker, swaps[index])
        version = sum(k <= index for k in swaps)
        record.append(version)
        yield version

    return turn, record


@pytest.mark.parametrize(
    ("weights", "segment"),
    [(ENDS_EARLY, 4), (ENDS_EARLY, 3), (RUNS_LONG, 5)],
    ids=["end-token-on-a-segment-boundary", "stopped-within-a-segment", "max-length-reached"],
)
def test_segments_without_a_weight_change_sample_what_one_call_does(
    engine, tiny_model_path, weights, segment
):
    load(engine, perturbed_state(tiny_model_path, seed=weights, scale=0.3))
    generate = generate_on(engine)
    prompts = engine.engine_state(TestPrompts).ids
    whole = generate(prompts, GREEDY, 11)
    eos = engine.engine_state(HFInferState).tokenizer.eos_token_id
    turn, record = turns(engine)
    parts = generate_in_segments(
        generate, prompts, GREEDY, 11, segment, end_token_ids(GREEDY, eos), turn
    )
    assert parts.prompt_ids == whole.prompt_ids
    assert parts.response_ids == whole.response_ids
    lengths = [len(r) for r in whole.response_ids]
    assert max(lengths) > segment  # some samples did span segments
    # Segments until the longest sample stopped: nothing more was asked of the engine.
    assert len(record) == -(-max(lengths) // segment)
    for got, want in zip(parts.response_logprobs, whole.response_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert parts.policy_versions == [[0] * n for n in lengths]


def test_a_weight_sync_between_segments_shows_in_versions_and_behaviour_logprobs(
    engine, tiny_model_path
):
    """Segment 1 samples with the first weights (version 0), the rest with the second
    (version 1); each token's behaviour log-prob is that of the weights that sampled it, as a
    transformers forward pass over those weights scores it."""
    first = perturbed_state(tiny_model_path, seed=ENDS_EARLY, scale=0.3)
    second = perturbed_state(tiny_model_path, seed=RUNS_LONG, scale=0.3)
    load(engine, first)
    segment = 3
    turn, record = turns(engine, swaps={1: second})
    eos = engine.engine_state(HFInferState).tokenizer.eos_token_id
    out = generate_in_segments(
        generate_on(engine),
        engine.engine_state(TestPrompts).ids,
        GREEDY,
        11,
        segment,
        end_token_ids(GREEDY, eos),
        turn,
    )
    assert record[0] == 0 and set(record[1:]) == {1}
    spanning = [i for i, r in enumerate(out.response_ids) if len(r) > segment]
    assert spanning, out.response_ids
    for i, versions in enumerate(out.policy_versions):
        n = len(out.response_ids[i])
        assert versions == [0] * min(n, segment) + [1] * max(0, n - segment)
    assert version_metrics(out, step=2) == {
        "rollout/partial_frac": len(spanning) / len(out.response_ids),
        # trained at step 2 (version 1): tokens of version 0 are one update stale
        "rollout/token_staleness_mean": sum(min(len(r), segment) for r in out.response_ids)
        / sum(len(r) for r in out.response_ids),
        "rollout/token_staleness_max": 1.0,
    }

    pad = engine.engine_state(HFInferState).tokenizer.pad_token_id
    batch = batch_of(out.prompt_ids, out.response_ids, pad, policy_versions=out.policy_versions)
    by_version = {0: reference_logprobs(tiny_model_path, first, batch)}
    by_version[1] = reference_logprobs(tiny_model_path, second, batch)
    for i, (prompt, lps) in enumerate(zip(out.prompt_ids, out.response_logprobs)):
        for j, lp in enumerate(lps):
            version = out.policy_versions[i][j]
            assert batch["policy_version"][i, len(prompt) + j] == version
            want = float(by_version[version][i, len(prompt) + j])
            assert abs(lp - want) < 1e-4, (i, j, version, lp, want)
    # The second weights' log-probs differ from the first's: the check above tells them apart.
    moved = [
        abs(float(by_version[0][i, len(p) + j]) - float(by_version[1][i, len(p) + j]))
        for i, p in enumerate(out.prompt_ids)
        for j in range(segment, len(out.response_ids[i]))
    ]
    assert min(moved) > 1e-3


def test_a_waiting_weight_sync_gets_the_engine_between_two_segments():
    """The producer of step 2 (one update ahead) is in its first of three segments when step
    1's weight sync comes: the sync goes next, and the remaining segments sample with the new
    version (a plain lock would let the producer take the engine straight back)."""
    seen: dict[int, list[int]] = {}
    step_2_started = threading.Event()

    def produce(index, timer, engine_turn):
        seen[index] = []
        for segment in range(3):
            with engine_turn() as version:
                seen[index].append(version)
                if index == 2 and segment == 0:
                    step_2_started.set()
                    # (the source, through its bound method: the constructor may not be back)
                    while not engine_turn.__self__._syncs_waiting:  # the sync below waits
                        time.sleep(0.01)
        return f"batch {index}", {}, {"position": index}

    def timer():
        return PhaseTimer(console=None, total_steps=0, start_step=0, show=False)

    source = AsyncBatches(produce, 0, 1, first=1, last=2, make_timer=timer, partial=True)
    try:
        assert source.next(1, timer()).policy_version == 0
        assert step_2_started.wait(10)
        source.sync_weights(lambda: {"bytes": 1}, version=1)
        assert source.next(2, timer()).policy_version == 0  # its oldest segment's
    finally:
        source.close()
    assert seen == {1: [0, 0, 0], 2: [0, 1, 1]}


def _workflow(model_dir, **algorithm) -> dict:
    return {
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "algorithm": {"group_size": 4, "rollout_batch_size": 8, **algorithm},
        "actor_train": {
            "strategy_args": {"strategy_name": "contract_fake_train"},
            "device_mapping": [0],
            "training_args": {"learning_rate": 1.0e-6},
        },
        "actor_infer": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": [1],
            "generating_args": {"max_new_tokens": 16},
        },
    }


def _errors(raw, host, tmp_path) -> dict[str, str]:
    """Each YAML path's errors, their texts joined."""
    _, report = build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))
    out: dict[str, str] = {}
    for issue in report.errors:
        out[issue.path] = out.get(issue.path, "") + issue.render() + "\n"
    return out


def test_partial_rollout_mistakes_are_reported_together(fake_train_host, model_dir, tmp_path):
    raw = _workflow(model_dir, partial_rollout=True, max_staleness=1)
    assert _errors(raw, fake_train_host, tmp_path) == {}  # the default segment: 16 // 4 tokens

    raw = _workflow(model_dir, partial_rollout=True, partial_rollout_segment_tokens=16)
    raw["actor_infer"]["generating_args"]["stop_strings"] = ["\n"]
    raw["environment"] = {"name": "calculator"}
    errors = _errors(raw, fake_train_host, tmp_path)
    assert "true with algorithm.max_staleness 0" in errors["algorithm.partial_rollout"]
    assert "set algorithm.max_staleness: 1" in errors["algorithm.partial_rollout"]
    assert "true with environment.name 'calculator'" in errors["algorithm.partial_rollout"]
    stop = errors["actor_infer.generating_args.stop_strings"]
    assert "['\\n'] with algorithm.partial_rollout" in stop and "stop_token_ids" in stop
    segment = errors["algorithm.partial_rollout_segment_tokens"]
    assert "16 is not below actor_infer.generating_args.max_new_tokens (16)" in segment
    assert "set it below 16" in segment

    raw = _workflow(model_dir, partial_rollout=True, partial_rollout_segment_tokens=0)
    errors = _errors(raw, fake_train_host, tmp_path)
    assert "0" in errors["algorithm.partial_rollout_segment_tokens"]
    assert ">= 1" in errors["algorithm.partial_rollout_segment_tokens"]


def test_versions_survive_select_and_concat():
    from posttrain.protocol import RolloutSamples

    def samples(tag):
        return RolloutSamples(
            prompt_ids=[[tag]] * 2,
            response_ids=[[1, 2], [3]],
            response_logprobs=[[-1.0, -2.0], [-3.0]],
            policy_versions=[[tag, tag + 1], [tag]],
        )

    both = RolloutSamples.concat([samples(0), samples(5)])
    assert both.policy_versions == [[0, 1], [0], [5, 6], [5]]
    assert both.select([3, 0]).policy_versions == [[5], [0, 1]]
    plain = attrs.evolve(samples(0), policy_versions=None)
    assert RolloutSamples.concat([plain, samples(1)]).policy_versions is None
