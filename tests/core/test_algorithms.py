"""Advantages, KL estimators and the clipped policy loss, against hand computations."""

from __future__ import annotations

import itertools
import math

import attrs
import pytest
import torch

from posttrain.algorithms.advantages import group_advantages
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.policy_loss import PolicyLoss
from posttrain.config.sections import AlgorithmConfig
from posttrain.protocol import SequenceBatch, build_sequence_batch

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`

# -- advantages --------------------------------------------------------------------------------


def test_group_advantages_with_std_norm():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4)
    std1 = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    std2 = math.sqrt((1 + 1 + 0 + 0) / 3)  # of [3, 1, 2, 2]
    expected = [
        0.5 / (std1 + 1e-6),
        -0.5 / (std1 + 1e-6),
        -0.5 / (std1 + 1e-6),
        0.5 / (std1 + 1e-6),
        1 / (std2 + 1e-6),
        -1 / (std2 + 1e-6),
        0.0,
        0.0,
    ]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert adv.shape == rewards.shape


def test_group_advantages_without_std_norm():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    adv = group_advantages(rewards, group_size=3, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0]))


@pytest.mark.parametrize("norm", [True, False])
def test_identical_rewards_give_zero_advantages(norm):
    rewards = torch.tensor([0.7] * 4 + [0.0] * 4 + [1.0] * 4)
    adv = group_advantages(rewards, group_size=4, norm_by_std=norm)
    assert torch.equal(adv, torch.zeros(12))
    assert torch.isfinite(adv).all()


def test_group_of_one_and_bad_split():
    assert torch.equal(group_advantages(torch.tensor([1.0, 2.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.ones(6), 4)


# -- KL ----------------------------------------------------------------------------------------


def test_kl_k1_and_k3_formulas():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen) * 4
    ref = -torch.rand(3, 5, generator=gen) * 4
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), logp - ref)
    d = ref - logp
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros(3, 5))
    # One number by hand: log p = -1, log p_ref = -2 -> r = e^-1, k3 = e^-1 - 1 - (-1).
    k3 = kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), "k3")
    assert float(k3) == pytest.approx(math.exp(-1), abs=1e-6)


def test_kl_k3_nonnegative_and_finite_for_extremes():
    logp = torch.tensor([-50.0, 0.0, -1e-3, -30.0])
    ref = torch.tensor([0.0, -50.0, -1e-3, -30.5])
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k2"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k2")


# -- the policy loss ---------------------------------------------------------------------------


def make_batch(adv_per_token, old, mask=None, meta=None) -> SequenceBatch:
    adv = torch.as_tensor(adv_per_token, dtype=torch.float32)
    mask = torch.ones_like(adv) if mask is None else torch.as_tensor(mask, dtype=torch.float32)
    batch = SequenceBatch(
        {
            "input_ids": torch.ones(adv.shape, dtype=torch.long),
            "attention_mask": torch.ones(adv.shape, dtype=torch.long),
            "response_mask": mask,
            "old_logprobs": torch.as_tensor(old, dtype=torch.float32),
            "advantages": adv * mask,
        }
    )
    batch.meta.update(
        global_tokens=float(mask.sum()), global_seqs=float(adv.shape[0]), dp_size=1, **(meta or {})
    )
    return batch


def test_ratio_one_gives_minus_mean_advantage_over_response_tokens():
    prompts = [[1, 5, 14], [1, 6], [1, 7, 14, 9]]
    responses = [[4, 5], [6, 7, 8, 9], [10]]
    batch = build_sequence_batch(prompts, responses, pad_token_id=0)
    adv = torch.tensor([0.5, -1.5, 2.0])
    logprobs = -torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    batch = batch.with_tensors(
        old_logprobs=logprobs.clone(), advantages=adv[:, None] * batch.response_mask
    )
    batch.meta.update(global_tokens=float(batch.response_mask.sum()), global_seqs=3.0)
    loss, metrics = PolicyLoss(AlgorithmConfig())(logprobs, None, batch)
    expected = -(0.5 * 2 - 1.5 * 4 + 2.0 * 1) / 7
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/clip_frac"] == 0.0
    assert metrics["actor/approx_kl_old"] == pytest.approx(0.0, abs=1e-7)
    assert "actor/entropy" not in metrics and "actor/kl_loss" not in metrics


def _clip_case(algorithm, adv, ratios):
    old = torch.full((1, len(ratios)), -1.0)
    logprobs = (old + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    batch = make_batch([adv], old)
    loss, metrics = PolicyLoss(algorithm)(logprobs, None, batch)
    loss.backward()
    return float(loss.detach()), metrics, logprobs.grad[0]


def test_clipping_zeroes_gradient_where_clipped_branch_is_active():
    adv = [1.0, 1.0, -1.0, -1.0, 1.0]
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1]
    loss, metrics, grad = _clip_case(AlgorithmConfig(clip_ratio=0.2), adv, ratios)
    # token 0: A>0, r>1.2 -> clipped, -1.2;  token 1: A>0, r<0.8 -> unclipped, -0.5
    # token 2: A<0, r<0.8 -> clipped, +0.8;  token 3: A<0, r>1.2 -> unclipped, +1.5
    # token 4: inside the range -> -1.1
    assert loss == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 - 1.1) / 5, abs=1e-6)
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 5)
    assert grad[0] == 0.0 and grad[2] == 0.0
    # d(-A r)/d(log p) = -A r, over 5 tokens
    expected = torch.tensor([0.0, -0.5, 0.0, 1.5, -1.1]) / 5
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_clip_higher_is_asymmetric():
    adv = [1.0, 1.0, -1.0, -1.0]
    ratios = [1.25, 1.3, 0.75, 0.85]
    sym_loss, sym_metrics, sym_grad = _clip_case(AlgorithmConfig(clip_ratio=0.2), adv, ratios)
    algo = AlgorithmConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics, grad = _clip_case(algo, adv, ratios)
    # Symmetric 0.2: tokens 0, 1 (above 1.2 with A>0) and 2 (below 0.8 with A<0) are clipped.
    assert sym_metrics["actor/clip_frac"] == pytest.approx(3 / 4)
    assert sym_loss == pytest.approx((-1.2 - 1.2 + 0.8 + 0.85) / 4, abs=1e-6)
    # Clip-higher: 1.25 is now inside [0.8, 1.28]; 1.3 is clipped at 1.28; low side unchanged.
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 4)
    assert loss == pytest.approx((-1.25 - 1.28 + 0.8 + 0.85) / 4, abs=1e-6)
    assert grad[0] == pytest.approx(-1.25 / 4, rel=1e-5) and sym_grad[0] == 0.0
    assert grad[1] == 0.0 and grad[2] == 0.0
    # Only the low bound set: the high bound falls back to clip_ratio.
    low_only = AlgorithmConfig(clip_ratio=0.3, clip_ratio_low=0.1)
    loss, metrics, _ = _clip_case(low_only, [1.0, -1.0], [1.35, 0.85])
    assert loss == pytest.approx((-1.3 + 0.9) / 2, abs=1e-6)
    assert metrics["actor/clip_frac"] == pytest.approx(1.0)


def _agg_batch():
    adv = [[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [-1.0, -1.0, 5.0, 2.0]]
    mask = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1]]
    old = torch.full((3, 4), -0.5)
    return make_batch(adv, old, mask), old.clone()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # per-token loss is -A on masked tokens (ratio 1)
        ("token-mean", -(1 + 2 + 3 + 4 - 1 + 5 + 2) / 7),
        ("seq-mean-token-sum", -((1 + 2 + 3) + 4 + (-1 + 5 + 2)) / 3),
        ("seq-mean-token-mean", -((6 / 3) + (4 / 1) + (6 / 3)) / 3),
    ],
)
def test_loss_agg_modes(mode, expected):
    batch, logprobs = _agg_batch()
    loss, _ = PolicyLoss(AlgorithmConfig(loss_agg_mode=mode))(logprobs, None, batch)
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_unknown_agg_mode():
    batch, logprobs = _agg_batch()
    algo = attrs.evolve(AlgorithmConfig(), loss_agg_mode="bogus")
    with pytest.raises(ValueError, match="bogus"):
        PolicyLoss(algo)(logprobs, None, batch)


def _random_batch(seed=0, rows=8, width=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    adv = torch.randn(rows, 1, generator=gen).expand(rows, width)
    old = -torch.rand(rows, width, generator=gen) * 3
    batch = make_batch(adv, old, mask)
    batch = batch.with_tensors(ref_logprobs=-torch.rand(rows, width, generator=gen) * 3)
    logprobs = old + 0.4 * torch.randn(rows, width, generator=gen)  # some tokens clip
    entropy = torch.rand(rows, width, generator=gen)
    return batch, logprobs, entropy


ALGOS = [
    AlgorithmConfig(loss_agg_mode="token-mean"),
    AlgorithmConfig(loss_agg_mode="seq-mean-token-sum", kl_coef=0.1, entropy_coef=0.01),
    AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.05, kl_estimator="k1"),
]


def _loss_and_grad(algo, batch, logprobs, entropy, rows):
    lp = logprobs[rows].clone().requires_grad_(True)
    part = batch.select(list(rows))
    loss, metrics = PolicyLoss(algo)(lp, entropy[rows], part)
    loss.backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.parametrize("algo", ALGOS, ids=lambda a: a.loss_agg_mode)
def test_micro_batches_sum_to_the_whole_batch(algo):
    batch, logprobs, entropy = _random_batch()
    whole, whole_grad, whole_metrics = _loss_and_grad(algo, batch, logprobs, entropy, range(8))
    assert whole_metrics["actor/clip_frac"] > 0  # the case exercises clipping
    for cuts in ([0, 3, 8], [0, 1, 2, 5, 8], [0, 4, 8]):
        total = torch.zeros(())
        grads, clip_frac = [], 0.0
        for lo, hi in itertools.pairwise(cuts):
            loss, grad, metrics = _loss_and_grad(algo, batch, logprobs, entropy, range(lo, hi))
            total += loss
            grads.append(grad)
            clip_frac += metrics["actor/clip_frac"]
        torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-5, atol=1e-7)
        assert clip_frac == pytest.approx(whole_metrics["actor/clip_frac"], abs=1e-6)


@pytest.mark.parametrize("algo", ALGOS, ids=lambda a: a.loss_agg_mode)
def test_data_parallel_average_equals_whole_batch(algo):
    batch, logprobs, entropy = _random_batch(seed=3)
    whole, whole_grad, _ = _loss_and_grad(algo, batch, logprobs, entropy, range(8))
    batch.meta["dp_size"] = 2  # the global counts stay those of the whole batch
    rank_losses, rank_grads = [], []
    for rank_rows in (range(0, 4), range(4, 8)):
        rows = list(rank_rows)
        # each rank further splits its share into two micro-batches
        loss_a, grad_a, _ = _loss_and_grad(algo, batch, logprobs, entropy, rows[:1])
        loss_b, grad_b, _ = _loss_and_grad(algo, batch, logprobs, entropy, rows[1:])
        rank_losses.append(loss_a + loss_b)
        rank_grads.append(torch.cat([grad_a, grad_b]))
    # DP gradient averaging: the mean over ranks equals the single-rank whole batch.
    torch.testing.assert_close((rank_losses[0] + rank_losses[1]) / 2, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(rank_grads) / 2, whole_grad, rtol=1e-5, atol=1e-7)


def test_kl_loss_term():
    batch, logprobs, _ = _random_batch(seed=5)
    base = AlgorithmConfig()
    plain, _ = PolicyLoss(base)(logprobs, None, batch)
    mask = batch.response_mask
    for estimator in ("k1", "k3"):
        algo = AlgorithmConfig(kl_coef=0.2, kl_estimator=estimator)
        loss, metrics = PolicyLoss(algo)(logprobs, None, batch)
        kl = kl_penalty(logprobs, batch["ref_logprobs"], estimator)
        kl_mean = float((kl * mask).sum() / mask.sum())
        assert float(loss) == pytest.approx(float(plain) + 0.2 * kl_mean, abs=1e-6)
        assert metrics["actor/kl_loss"] == pytest.approx(kl_mean, abs=1e-6)
    # No term when kl_coef is 0, when KL goes into the reward, or with no reference log-probs.
    no_ref = SequenceBatch(
        {k: v for k, v in batch.tensors.items() if k != "ref_logprobs"}, dict(batch.meta)
    )
    for algo, b in [
        (AlgorithmConfig(kl_coef=0.0), batch),
        (AlgorithmConfig(kl_coef=0.2, kl_mode="reward"), batch),
        (AlgorithmConfig(kl_coef=0.2), no_ref),
    ]:
        loss, metrics = PolicyLoss(algo)(logprobs, None, b)
        assert float(loss) == pytest.approx(float(plain), abs=1e-7)
        assert "actor/kl_loss" not in metrics


def test_entropy_bonus():
    batch, logprobs, entropy = _random_batch(seed=7)
    mask = batch.response_mask
    ent_mean = float((entropy * mask).sum() / mask.sum())
    plain, metrics = PolicyLoss(AlgorithmConfig())(logprobs, entropy, batch)
    assert metrics["actor/entropy"] == pytest.approx(ent_mean, abs=1e-6)
    bonus, _ = PolicyLoss(AlgorithmConfig(entropy_coef=0.05))(logprobs, entropy, batch)
    assert float(bonus) == pytest.approx(float(plain) - 0.05 * ent_mean, abs=1e-6)
    # The bonus pushes entropy up: its gradient is -coef / tokens on response tokens.
    ent = entropy.clone().requires_grad_(True)
    loss, _ = PolicyLoss(AlgorithmConfig(entropy_coef=0.05))(logprobs, ent, batch)
    loss.backward()
    torch.testing.assert_close(ent.grad, -0.05 * mask / mask.sum())


def test_logprobs_narrower_than_batch():
    batch, logprobs = _agg_batch()
    wide = SequenceBatch(
        {
            k: torch.nn.functional.pad(v, (0, 3)) if v.dim() == 2 else v
            for k, v in batch.tensors.items()
        },
        dict(batch.meta),
    )
    a, _ = PolicyLoss(AlgorithmConfig())(logprobs, None, batch)
    b, _ = PolicyLoss(AlgorithmConfig())(logprobs, None, wide)
    assert float(a) == pytest.approx(float(b), abs=1e-7)
