"""The episode runner on the real engine (hf_infer in this process, preset:tiny-qwen2): masks,
log-probs and rewards of multi-turn episodes, broken environments, the turn limit and the token
budget."""

from __future__ import annotations

import logging

import pytest
import torch
from env_support import HANGS, RAISES, RELEASE_HUNG, SPECS

from posttrain.config.sections import EnvironmentConfig
from posttrain.protocol import GenerationRequest, SamplingParams, build_sequence_batch
from posttrain.rewards.functions import exact_match
from posttrain.rewards.pool import RuleRewards
from posttrain.rollout.environments.runner import EpisodeRunner
from posttrain.tasks.data import Prompt
from posttrain.testing.expected import reference_logprobs
from posttrain_hf_infer.engine import HFInferState

SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0)


@pytest.fixture(scope="module", params=["dynamic", "static", "compiled"])
def engine(hf_infer_settings, request):
    """The engine in each decode mode (``cuda_graph`` is ``static`` on the CPU; ``compiled``
    runs its compiled step and fused sampling there too)."""
    with hf_infer_settings(decode=request.param) as worker:
        yield worker


class Recorder:
    """``generate`` for the runner on the engine; keeps each round's contexts and samples."""

    def __init__(self, worker):
        self.worker = worker
        self.rounds: list[tuple[list[list[int]], list[list[int]]]] = []

    def __call__(self, contexts, sampling, turn):
        from posttrain_hf_infer import engine as hf_infer

        request = GenerationRequest(prompt_ids=contexts, sampling=sampling, seed=11 + turn)
        out = hf_infer.generate(self.worker, request)
        self.rounds.append((contexts, out.response_ids))
        return out


def prompts(tokenizer, answers: list[int]) -> list[Prompt]:
    texts = [f"{a}+0=" for a in answers]
    return [
        Prompt(text=t, answer=str(a), ids=tuple(tokenizer(t)["input_ids"]))
        for t, a in zip(texts, answers)
    ]


def runner(engine, name: str, score=None, log_dir=None, **settings) -> EpisodeRunner:
    config = EnvironmentConfig(name=name, **settings)
    return EpisodeRunner(
        SPECS[name], config, engine.engine_state(HFInferState).tokenizer, score, log_dir
    )


def test_model_tokens_are_trained_and_observations_are_not(engine):
    tokenizer = engine.engine_state(HFInferState).tokenizer
    score = RuleRewards(exact_match, "posttrain.rewards.functions:exact_match", {})
    run = runner(engine, "countdown", score, kwargs={"turns": 3}, max_turns=4)
    generate = Recorder(engine)
    out = run.run(prompts(tokenizer, [4, 7]), 2, generate, SAMPLING, "step 1")
    samples = out.samples
    observation = tokenizer("=5", add_special_tokens=False)["input_ids"]
    assert len(generate.rounds) == 3
    for row in range(4):
        # The response is turn, observation, turn, observation, turn: rebuilt from the engine's
        # answers, each round's context being everything so far.
        turns = [answers[row] for _, answers in generate.rounds]
        want_ids, want_mask, want_rewards = [], [], []
        for k, ids in enumerate(turns):
            want_ids += ids
            want_mask += [1] * len(ids)
            want_rewards += [0.0] * (len(ids) - 1) + [0.25 + (1.0 if k == 2 else 0.0)]
            if k < 2:
                want_ids += observation
                want_mask += [0] * len(observation)
                want_rewards += [0.0] * len(observation)
                assert generate.rounds[k + 1][0][row] == samples.prompt_ids[row] + want_ids
        assert samples.response_ids[row] == want_ids
        assert samples.loss_mask[row] == want_mask
        assert out.turn_rewards[row] == pytest.approx(want_rewards)
    # 0.25 for each of 3 turns, and exact_match's 1 for the answer handed over at the end.
    assert out.rewards == [1.75] * 4
    assert out.metrics["env/turns_mean"] == 3 and out.metrics["env/tool_calls_mean"] == 2
    assert out.metrics["env/tool_call_rate"] == 1 and out.metrics["env/errors"] == 0
    # The model's tokens keep the engine's log-probs (a plain forward pass agrees); the
    # observation's are 0 and masked out of the batch.
    batch = build_sequence_batch(
        samples.prompt_ids,
        samples.response_ids,
        tokenizer.pad_token_id,
        samples.response_logprobs,
        loss_mask=samples.loss_mask,
    )
    mask = batch.response_mask
    ref = reference_logprobs(engine.model_args.model_name_or_path, None, batch)
    torch.testing.assert_close(batch["rollout_logprobs"] * mask, ref * mask, atol=1e-4, rtol=0)
    assert float((batch["rollout_logprobs"] * (1 - mask)).abs().sum()) == 0.0
    assert float(mask.sum()) == sum(sum(m) for m in samples.loss_mask)


def test_broken_environments_score_zero_and_the_others_go_on(engine, caplog, tmp_path):
    tokenizer = engine.engine_state(HFInferState).tokenizer
    run = runner(engine, "broken", log_dir=tmp_path, kwargs={"turns": 3}, step_timeout_s=0.5)
    answers = [0, int(RAISES), int(HANGS), 3]  # 3: garbage (a NaN reward)
    RELEASE_HUNG.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="posttrain.rollout.environments.runner"):
            out = run.run(prompts(tokenizer, answers), 2, Recorder(engine), SAMPLING, "step 7")
    finally:
        RELEASE_HUNG.set()
    assert out.rewards == [0.75, 0.75] + [0.0] * 6
    assert sum(map(sum, out.turn_rewards[2:])) == 0
    assert out.metrics["env/errors"] == 4 and out.metrics["env/timeouts"] == 2
    # One console line for the step; each failure, with its episode's id, in the log file.
    (line,) = [r.getMessage() for r in caplog.records]
    assert "step 7: 6 of 8 episodes failed and score 0 (4 errors, 2 timeouts)" in line
    log = (tmp_path / "environments.log").read_text()
    for sample in (0, 1):
        assert f"step 7 prompt 1 sample {sample}: turn 1: step() raised RuntimeError" in log
        assert f"step 7 prompt 2 sample {sample}: turn 1: step() did not answer within 0.5s" in log
        assert f"step 7 prompt 3 sample {sample}: turn 1: step() answered garbage" in log
    # The healthy episodes went on to their third turn; the broken ones stopped at their second.
    assert [len(m) > 0 for m in out.samples.loss_mask] == [True] * 8
    assert out.metrics["env/turns_mean"] == (3 * 2 + 2 * 6) / 8


@pytest.mark.parametrize(
    ("settings", "ended_by"),
    [({"max_turns": 3}, "turn_limited"), ({"max_total_tokens": 7}, "truncated")],
)
def test_the_turn_limit_and_the_token_budget_end_episodes(engine, settings, ended_by):
    tokenizer = engine.engine_state(HFInferState).tokenizer
    run = runner(engine, "countdown", kwargs={"turns": 0, "reward": 1.0}, **settings)
    generate = Recorder(engine)
    out = run.run(prompts(tokenizer, [1, 2]), 2, generate, SAMPLING, "step 1")
    assert out.metrics[f"env/{ended_by}"] == 4
    budget = settings.get("max_total_tokens", 512)
    for ids, mask, logprobs in zip(
        out.samples.response_ids, out.samples.loss_mask, out.samples.response_logprobs
    ):
        assert len(ids) == len(mask) == len(logprobs) <= budget
        assert mask[-1] == 1  # the last model turn is kept, and nothing after it
    if ended_by == "turn_limited":
        assert len(generate.rounds) == 3 and out.rewards == [3.0] * 4
