"""Partial rollout (``algorithm.partial_rollout``): generations made in segments of at most
``partial_rollout_segment_tokens`` new tokens, the rollout engine released between two segments.

With asynchronous rollout the trainer's weight sync waits for the engine. Generating a batch in
one call makes it wait for the batch's longest sample; in segments it waits for one segment at
most, and the samples still running go on with the new weights (Kimi k1.5's and slime's partial
rollouts). Each token keeps the policy version that sampled it and its behaviour log-prob (the
engine's, at sampling time): the PPO ratio (``old_logprobs: rollout``) and the rollout
correction (``tis_cap``) use those per token, so a sample that spans versions is weighed
against the policy that sampled each of its tokens.

A sample is done when its segment came back short (the engine stopped it: an end token, a stop
string), when it ends with an end token, or when it reached ``max_new_tokens``. The samples
still running after a segment all have the same length, so every segment asks one length of
all of them. A continued sample's prompt is its prompt and its response so far; its tokens are
never re-encoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import attrs

from posttrain.protocol import RolloutSamples, SamplingParams

if TYPE_CHECKING:
    from posttrain.config.sections import AlgorithmConfig, GeneratingArgs

# generate(prompt_ids, sampling, seed): one call of the rollout engine (over its ranks).
Generate = Callable[[list[list[int]], SamplingParams, int], RolloutSamples]
# A turn on the rollout engine: held for one segment, it yields the policy version the engine
# holds meanwhile (no weight sync can come during the turn).
EngineTurn = Callable[[], AbstractContextManager[int]]

# Seeds of a generation's segments: the first segment's is the generation's own, so with one
# segment a partial rollout samples what a plain one does.
SEGMENT_SEED_STRIDE = 104_729


def segment_tokens(algorithm: AlgorithmConfig, generating_args: GeneratingArgs | None) -> int:
    """``partial_rollout_segment_tokens``, its default resolved: a quarter of the generation's
    ``max_new_tokens`` (at least 1)."""
    if algorithm.partial_rollout_segment_tokens is not None:
        return algorithm.partial_rollout_segment_tokens
    max_new_tokens = generating_args.max_new_tokens if generating_args else 32
    return max(1, max_new_tokens // 4)


def end_token_ids(sampling: SamplingParams, eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end a sample: the stop tokens, and end-of-sequence unless ignored."""
    ids = set(sampling.stop_token_ids)
    if eos_token_id is not None and not sampling.ignore_eos:
        ids.add(eos_token_id)
    return frozenset(ids)


def generate_in_segments(
    generate: Generate,
    prompt_ids: list[list[int]],
    sampling: SamplingParams,
    seed: int,
    segment: int,
    end_ids: Iterable[int],
    engine_turn: EngineTurn,
) -> RolloutSamples:
    """``sampling.n`` samples of every prompt, as ``generate`` would make them in one call,
    generated ``segment`` tokens at a time, each segment in a turn of its own on the engine.
    The samples carry ``policy_versions``: per token, the version of the turn that sampled it."""
    end_ids = frozenset(end_ids)
    rows = [list(p) for p in prompt_ids for _ in range(sampling.n)]
    responses: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    versions: list[list[int]] = [[] for _ in rows]
    running = list(range(len(rows)))
    done_tokens, index = 0, 0
    while running:
        budget = min(segment, sampling.max_new_tokens - done_tokens)
        if index == 0:  # the prompts themselves: n samples of each, as one call would draw
            contexts, n = [list(p) for p in prompt_ids], sampling.n
        else:
            contexts, n = [rows[r] + responses[r] for r in running], 1
        part = attrs.evolve(sampling, n=n, max_new_tokens=budget)
        with engine_turn() as version:
            out = generate(contexts, part, seed + index * SEGMENT_SEED_STRIDE)
        done_tokens += budget
        still = []
        for r, got, lps in zip(running, out.response_ids, out.response_logprobs):
            responses[r] += got
            logprobs[r] += lps
            versions[r] += [version] * len(got)
            stopped = len(got) < budget or (bool(got) and got[-1] in end_ids)
            if not stopped and done_tokens < sampling.max_new_tokens:
                still.append(r)
        running, index = still, index + 1
    return RolloutSamples(
        prompt_ids=rows,
        response_ids=responses,
        response_logprobs=logprobs,
        policy_versions=versions,
    )


def version_metrics(samples: RolloutSamples, step: int) -> dict[str, float]:
    """How stale the batch's tokens are for the update of ``step`` (made at version
    ``step - 1``), and the fraction of samples whose tokens come from more than one version."""
    versions = samples.policy_versions
    if not versions:
        return {}
    tokens = [step - 1 - v for row in versions for v in row]
    spanning = sum(len(set(row)) > 1 for row in versions)
    return {
        "rollout/partial_frac": spanning / len(versions),
        "rollout/token_staleness_mean": sum(tokens) / len(tokens) if tokens else 0.0,
        "rollout/token_staleness_max": float(max(tokens, default=0)),
    }
