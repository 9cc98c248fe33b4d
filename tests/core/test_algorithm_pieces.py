"""The registered algorithm pieces against hand computations: RLOO, REINFORCE++, GAE, the
dual-clip and GSPO losses, the value loss, rollout correction, and the registry's checks."""

from __future__ import annotations

import pytest
import torch
from test_algorithms import _clip_case, make_batch

from posttrain import hookimpl
from posttrain.algorithms import advantages as adv
from posttrain.algorithms.correction import tis_weights
from posttrain.algorithms.policy_loss import PolicyLoss, gspo_surrogate
from posttrain.algorithms.registry import AdvantageEstimator, Advantages, PolicyLossTerm
from posttrain.algorithms.value_loss import ValueLoss
from posttrain.config.report import ErrorReport
from posttrain.config.sections import AlgorithmConfig
from posttrain.host.plugin_host import create_plugin_host
from posttrain.loading.workflow import build_workflow
from posttrain.protocol import SequenceBatch, build_sequence_batch

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`


def response_batch(lengths: list[int], prompt_len: int = 2, **tensors) -> SequenceBatch:
    batch = build_sequence_batch(
        [[1] * prompt_len for _ in lengths], [[5] * n for n in lengths], pad_token_id=0
    )
    return batch.with_tensors(**tensors) if tensors else batch


def test_rloo_baseline_is_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    out = adv.leave_one_out_advantages(rewards, group_size=3)
    torch.testing.assert_close(out, torch.tensor([1.0, -0.5, -0.5, -1.0, 0.5, 0.5]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        adv.leave_one_out_advantages(rewards, group_size=1)


def test_token_rewards_put_the_score_on_the_last_token_and_kl_on_every_token():
    batch = response_batch([2, 3])
    kl = batch.response_mask * 0.1
    batch = batch.with_tensors(token_kl=kl)
    algo = AlgorithmConfig(kl_coef=0.5, kl_mode="reward")
    rewards = adv.token_rewards(batch, torch.tensor([1.0, 2.0]), algo)
    expected = torch.zeros_like(rewards)
    expected[0, 2:4] = -0.05
    expected[1, 2:5] = -0.05
    expected[0, 3] += 1.0
    expected[1, 4] += 2.0
    torch.testing.assert_close(rewards, expected)
    # The KL as a loss term leaves the rewards alone.
    plain = adv.token_rewards(batch, torch.tensor([1.0, 2.0]), AlgorithmConfig(kl_coef=0.5))
    assert float(plain.sum()) == 3.0


def test_turn_rewards_stay_on_their_turns_and_environment_tokens_are_skipped():
    # One response: model, model | environment, environment | model, model.
    batch = build_sequence_batch(
        [[1]],
        [[5, 5, 6, 6, 5, 5]],
        pad_token_id=0,
        loss_mask=[[1, 1, 0, 0, 1, 1]],
        turn_rewards=[[0, 0.5, 0, 0, 0, 1.0]],
    )
    # The score is the turns' 1.5 plus 0.25 from a reward model, which goes on the last token.
    rewards = adv.token_rewards(batch, torch.tensor([1.75]), AlgorithmConfig())
    assert rewards[0].tolist() == [0, 0, 0.5, 0, 0, 0, 1.25]
    returns = adv.discounted_returns(rewards, batch.response_mask, gamma=0.5)
    # The environment's tokens neither earn nor discount: 0.5 + 0.5 * (0 + 0.5 * 1.25) on the
    # first turn's last token.
    assert returns[0].tolist() == [0, 0.40625, 0.8125, 0, 0, 0.625, 1.25]


def test_gae_against_the_recursion():
    batch = response_batch([3, 1])
    values = torch.zeros_like(batch.response_mask)
    values[0, 2:5] = torch.tensor([0.5, 0.2, 0.4])
    values[1, 2] = 0.3
    batch = batch.with_tensors(values=values)
    algo = AlgorithmConfig(gamma=0.9, lam=0.8, whiten_advantages=False)
    out = adv.gae(batch, torch.tensor([1.0, -1.0]), algo)
    # Row 0: rewards [0, 0, 1], values [0.5, 0.2, 0.4]; V after the last token is 0.
    d2 = 1.0 - 0.4
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.9 * 0.8 * a2
    a0 = d0 + 0.9 * 0.8 * a1
    torch.testing.assert_close(out.advantages[0, 2:5], torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(out.advantages[1, 2], torch.tensor(-1.0 - 0.3))
    torch.testing.assert_close(out.returns, (out.advantages + values) * batch.response_mask)
    assert float(out.advantages[:, :2].abs().sum()) == 0.0  # nothing on the prompt
    whitened = adv.gae(batch, torch.tensor([1.0, -1.0]), AlgorithmConfig(gamma=0.9, lam=0.8))
    mask = batch.response_mask
    assert float((whitened.advantages * mask).sum()) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(whitened.returns, out.returns)  # targets are not whitened


def test_gae_of_one_token_answers_is_the_reward_minus_the_prompts_value():
    """The quickstart's case (one answer token, gamma = lam = 1): the value the critic's head
    gives at the last prompt token (the state the answer was chosen in, as shifted_values aligns
    it) is the baseline, the return is the reward itself, and nothing leaks from the answer's own
    position (where the head has seen the answer)."""
    from posttrain.scoring.modeling import shifted_values

    batch = response_batch([1, 1, 1], prompt_len=3)
    # The head at every position: the prompt's last one (index 2) holds V(prompt); the answer's
    # position (index 3) holds a value that saw the answer and must not be used.
    head = torch.tensor([[0.0, 0.0, 0.3, 9.0], [0.0, 0.0, 0.8, 9.0], [0.0, 0.0, 0.5, 9.0]])
    values = shifted_values(head[:, :, None]) * batch.response_mask
    assert values[:, 3].tolist() == pytest.approx([0.3, 0.8, 0.5])
    scores = torch.tensor([1.0, 0.0, 1.0])
    algo = AlgorithmConfig(gamma=1.0, lam=1.0, whiten_advantages=False)
    out = adv.gae(batch.with_tensors(values=values), scores, algo)
    torch.testing.assert_close(out.advantages[:, 3], scores - torch.tensor([0.3, 0.8, 0.5]))
    torch.testing.assert_close(out.returns[:, 3], scores)
    assert float(out.advantages[:, :3].abs().sum()) == 0.0


def test_reinforce_plus_plus_whitens_discounted_returns():
    batch = response_batch([2, 2])
    out = adv.reinforce_plus_plus(batch, torch.tensor([1.0, 0.0]), AlgorithmConfig(gamma=0.5))
    # Returns: row 0 [0.5, 1.0], row 1 [0, 0]; whitened over the 4 response tokens.
    returns = torch.tensor([0.5, 1.0, 0.0, 0.0])
    expected = (returns - returns.mean()) / returns.std()
    got = out.advantages[batch.response_mask > 0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert out.returns is None


def test_dual_clip_caps_the_loss_of_negative_advantages():
    algo = AlgorithmConfig(clip_ratio=0.2, clip_ratio_c=3.0)
    loss, metrics, grad = _clip_case(algo, [-1.0, -1.0], [5.0, 2.0])
    # ratio 5 with A = -1: max(5, 1.2) = 5, capped at 3; ratio 2: 2 < 3 stays.
    assert loss == pytest.approx((3.0 + 2.0) / 2, abs=1e-6)
    assert metrics["actor/dual_clip_frac"] == pytest.approx(0.5)
    assert grad[0] == 0.0 and grad[1] != 0.0
    off, _, _ = _clip_case(AlgorithmConfig(clip_ratio=0.2, clip_ratio_c=None), [-1.0], [5.0])
    assert off == pytest.approx(5.0, abs=1e-5)


def test_gspo_uses_one_ratio_per_sequence():
    old = torch.full((2, 3), -1.0)
    shifts = torch.tensor([[0.3, -0.1, 0.1], [0.0, 0.0, 0.0]])
    logprobs = (old + shifts).requires_grad_(True)
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.ones(2, 3)
    algo = AlgorithmConfig(clip_ratio=10.0)
    per_token, _ = gspo_surrogate(logprobs, old, advantages, mask, algo)
    seq_ratio = torch.exp(shifts.mean(dim=1))
    torch.testing.assert_close(per_token.detach(), -advantages * seq_ratio[:, None])
    per_token.sum().backward()
    # d/d logp_t of -A * s_i (s_i carried with token t's own gradient): -A * s_i.
    torch.testing.assert_close(logprobs.grad, -advantages * seq_ratio[:, None])


def test_value_loss_clips_around_the_old_values():
    values = torch.tensor([[0.0, 1.0, 0.0]], requires_grad=True)
    batch = make_batch([[0.0, 0.0, 0.0]], torch.zeros(1, 3), mask=[[0, 1, 1]])
    batch = batch.with_tensors(
        values=torch.tensor([[0.0, 0.2, 0.0]]), returns=torch.tensor([[0.0, 2.0, 0.5]])
    )
    batch.meta.update(global_tokens=2.0, dp_size=1)
    loss, metrics = ValueLoss(AlgorithmConfig(cliprange_value=0.5))(values, None, batch)
    # token 1: unclipped (1-2)^2 = 1, clipped (0.2+0.5-2)^2 = 1.69 -> 1.69; token 2: 0.25 both.
    assert float(loss.detach()) == pytest.approx(0.5 * (1.69 + 0.25) / 2, abs=1e-6)
    assert metrics["critic/vf_clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert values.grad[0, 1] == 0.0 and values.grad[0, 0] == 0.0
    plain, _ = ValueLoss(AlgorithmConfig(cliprange_value=None))(values, None, batch)
    assert float(plain.detach()) == pytest.approx(0.5 * (1.0 + 0.25) / 2, abs=1e-6)


def test_tis_weights_are_truncated_ratios_and_weight_the_loss():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    rollout = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    weights, metrics = tis_weights(old, rollout, mask, cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0, 0.5]]))
    assert metrics["rollout/tis_weight_max"] == pytest.approx(2.0)
    assert metrics["rollout/tis_capped_frac"] == pytest.approx(1 / 3)
    batch = make_batch([[1.0, 1.0, 1.0]], old).with_tensors(tis_weights=weights)
    batch.meta.update(global_tokens=3.0, global_seqs=1.0, dp_size=1)
    loss, _ = PolicyLoss(AlgorithmConfig())(old.clone(), None, batch)
    assert float(loss) == pytest.approx(-(1.5 + 1.0 + 0.5) / 3, abs=1e-6)


def test_old_logprobs_are_recomputed_for_rollout_correction():
    assert AlgorithmConfig().old_logprobs_source() == "rollout"
    assert AlgorithmConfig(tis_cap=2.0).old_logprobs_source() == "recompute"
    # Asynchronous, one update per batch: the ratio measures against the policy that sampled.
    assert AlgorithmConfig(max_staleness=1).old_logprobs_source() == "rollout"
    assert AlgorithmConfig(max_staleness=1, ppo_epochs=2).old_logprobs_source() == "recompute"


# -- the registry ------------------------------------------------------------------------------


class ThirdPartyPieces:
    """A plugin adding an estimator and a loss, as a third-party package would."""

    @hookimpl
    def posttrain_add_advantage_estimators(self):
        return {
            "sign": AdvantageEstimator(
                estimate=lambda batch, scores, algo: Advantages(
                    advantages=torch.sign(scores)[:, None] * batch.response_mask
                )
            )
        }

    @hookimpl
    def posttrain_add_policy_losses(self):
        return {"reinforce": PolicyLossTerm(surrogate=lambda lp, old, a, m, cfg: (-a * lp, {}))}


def _algorithm_errors(algorithm: dict, host, model_dir, tmp_path, **sections) -> list:
    raw = {
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "algorithm": algorithm,
        "actor_train": {"strategy_args": {"strategy_name": "hf_infer"}},
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}},
        **sections,
    }
    report = ErrorReport()
    build_workflow(raw, host, report, base_dir=str(tmp_path))
    return [e for e in report.errors if e.path.startswith(("algorithm", "critic", "plugins"))]


def test_third_party_pieces_are_picked_by_name(model_dir, tmp_path):
    host = create_plugin_host()
    algo = {"name": "grpo", "advantage_estimator": "sign", "policy_loss": "reinforce"}
    errors = _algorithm_errors(algo, host, model_dir, tmp_path)
    assert [e.message for e in errors] == ["unknown advantage estimator 'sign'"]
    host.pm.register(ThirdPartyPieces(), name="third-party-pieces")
    assert _algorithm_errors(algo, host, model_dir, tmp_path) == []


def test_algorithm_names_are_checked_with_suggestions(model_dir, tmp_path):
    host = create_plugin_host()
    errors = _algorithm_errors({"name": "rlo"}, host, model_dir, tmp_path)
    assert errors[0].path == "algorithm.name"
    assert "did you mean 'rloo'" in errors[0].hint
    errors = _algorithm_errors({"name": "grpo", "policy_loss": "gspoo"}, host, model_dir, tmp_path)
    assert errors[0].path == "algorithm.policy_loss" and "gspo" in errors[0].hint
    errors = _algorithm_errors({"name": "rloo", "group_size": 1}, host, model_dir, tmp_path)
    assert [e.path for e in errors] == ["algorithm.group_size"]
    errors = _algorithm_errors(
        {"name": "grpo", "tis_cap": 2.0, "old_logprobs": "rollout"}, host, model_dir, tmp_path
    )
    assert [e.path for e in errors] == ["algorithm.tis_cap"]


def test_a_critic_goes_with_an_estimator_that_uses_values(model_dir, tmp_path):
    host = create_plugin_host()
    errors = _algorithm_errors({"name": "ppo"}, host, model_dir, tmp_path)
    assert [e.path for e in errors] == ["critic"] and "needs values" in errors[0].message
    critic = {"strategy_args": {"strategy_name": "hf_infer"}}
    errors = _algorithm_errors({"name": "grpo"}, host, model_dir, tmp_path, critic=critic)
    assert "critic" in [e.path for e in errors]
    assert "does not use a critic's values" in " ".join(e.message for e in errors)


def test_two_plugins_declaring_one_estimator_is_an_error(model_dir, tmp_path):
    host = create_plugin_host()

    class Clash:
        @hookimpl
        def posttrain_add_advantage_estimators(self):
            return {"gae": AdvantageEstimator(estimate=adv.gae)}

    host.pm.register(Clash(), name="clash")
    errors = _algorithm_errors({"name": "grpo"}, host, model_dir, tmp_path)
    assert errors[0].path == "plugins" and "'gae'" in errors[0].message


def test_a_workflow_without_any_reward_is_refused(model_dir, tmp_path):
    host = create_plugin_host()
    raw = {
        "model_args": {"model_name_or_path": str(model_dir)},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "actor_train": {"strategy_args": {"strategy_name": "hf_infer"}},
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}},
        "reward": {"function": None},
    }
    report = ErrorReport()
    build_workflow(raw, host, report, base_dir=str(tmp_path))
    assert [e.path for e in report.errors if e.path.startswith("reward")] == ["reward"]
    raw["reward"] = {
        "function": None,
        "strategy_args": {"strategy_name": "hf_infer"},
        "model_args": {"model_name_or_path": str(model_dir)},
    }
    report = ErrorReport()
    build_workflow(raw, host, report, base_dir=str(tmp_path))
    assert not [e for e in report.errors if e.path.startswith("reward")]
