"""Policy and value losses against numbers worked out by hand (each test says how)."""

import math

import pytest
import torch

from rlplat_algorithms import policy_losses
from rlplat.losses import PolicyLossConfig
from rlplat.losses.value import value_loss


def tokens(ratios, advantages, old_log_prob=-1.0):
    """One row whose token ratios are ``ratios``: ``log_prob = old_log_prob + log(ratio)``."""
    old = torch.full((1, len(ratios)), old_log_prob, dtype=torch.float64)
    log_prob = (old + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_()
    return dict(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=torch.tensor([advantages], dtype=torch.float64),
        response_mask=torch.ones(1, len(ratios), dtype=torch.float64),
    )


def test_vanilla_clips_each_side_and_applies_the_dual_clip_bound():
    # clip 0.2: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2; A=-1, r=0.5 -> max(0.5, 0.8) = 0.8;
    # A=-1, r=5 -> max(5, 1.2) = 5, dual clip min(3, 5) = 3. token-mean (-1.2 + 0.8 + 3) / 3
    inputs = tokens([1.5, 0.5, 5.0], [1.0, -1.0, -1.0])
    loss, metrics = policy_losses.vanilla(**inputs, loss_agg_mode="token-mean", config=None)
    assert loss.item() == pytest.approx(2.6 / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)  # the first two took the clipped term
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)  # the third hit the dual bound
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 3)


def test_vanilla_uses_separate_low_and_high_clip_ratios():
    # low 0.1, high 0.3: A=+1, r=1.25 stays (< 1.3) -> -1.25; A=-1, r=0.85 clips to 0.9 -> 0.9
    inputs = tokens([1.25, 0.85], [1.0, -1.0])
    config = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3}
    loss, _ = policy_losses.vanilla(**inputs, loss_agg_mode="seq-mean-token-sum", config=config)
    assert loss.item() == pytest.approx(-1.25 + 0.9)


def test_vanilla_clipped_tokens_get_no_gradient():
    # r = 1.5 with A = +1 is clipped at 1.2: constant in log_prob; r = 1.1 is not: d(-A r)/d log_prob = -1.1
    inputs = tokens([1.5, 1.1], [1.0, 1.0])
    loss, _ = policy_losses.vanilla(**inputs, loss_agg_mode="seq-mean-token-sum", config=None)
    loss.backward()
    torch.testing.assert_close(inputs["log_prob"].grad, torch.tensor([[0.0, -1.1]], dtype=torch.float64))


def test_vanilla_refuses_a_dual_clip_bound_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_losses.vanilla(**tokens([1.0], [1.0]), loss_agg_mode="token-mean", config={"clip_ratio_c": 1.0})


def test_gspo_uses_the_sequence_ratio_and_aggregates_by_the_mode_it_is_given():
    # log ratios 0.1 and 0.3 -> sequence ratio exp(0.2) = 1.2214 > 1.2 with A = +1: both tokens -1.2.
    # a second row of one token with ratio 1, A = -1: loss 1. verl 0.9.1 passes loss_agg_mode to agg_loss:
    # seq-mean-token-mean gives (-1.2 + 1) / 2 = -0.1; token-mean gives (-1.2 - 1.2 + 1) / 3 = -0.4667.
    old = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-0.9, -0.7], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    inputs = dict(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64),
    )
    expected = {"seq-mean-token-mean": (-1.2 + 1.0) / 2, "token-mean": (-1.2 - 1.2 + 1.0) / 3}
    for mode, value in expected.items():
        loss, metrics = policy_losses.gspo(**inputs, loss_agg_mode=mode, config=None)
        assert loss.item() == pytest.approx(value)
        assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)


def test_cispo_keeps_a_gradient_through_the_clipped_weight():
    # r = 1.5 clipped to 1.2 and detached: loss -1.2 * A * log_prob, gradient -1.2 * A = -1.2
    inputs = tokens([1.5], [1.0], old_log_prob=-1.0)
    loss, metrics = policy_losses.cispo(**inputs, loss_agg_mode="token-mean", config=None)
    assert loss.item() == pytest.approx(-1.2 * (-1.0 + math.log(1.5)))
    loss.backward()
    assert inputs["log_prob"].grad.item() == pytest.approx(-1.2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)  # masked mean: count / (count + 1e-8)


def test_reinforce_is_minus_advantage_times_log_prob_without_clipping():
    # log_prob = -1 + log 5 (ratio 5 is never clipped): loss = -2 * log_prob, gradient -2
    inputs = tokens([5.0], [2.0])
    loss, _ = policy_losses.reinforce(**inputs, loss_agg_mode="token-mean", config=None)
    assert loss.item() == pytest.approx(-2.0 * (-1.0 + math.log(5.0)))
    loss.backward()
    assert inputs["log_prob"].grad.item() == pytest.approx(-2.0)


def test_kl_cov_adds_the_kl_term_on_the_highest_covariance_token():
    # A = [1, -1, 0, 0], log_prob = [-1, -2, -3, -4]: centred covariance [1 * 1.5, -1 * 0.5, 0, 0];
    # kl_cov_ratio 0.25 of 4 tokens selects token 0, whose log ratio is 0.5:
    # token 0: -e^0.5 + 0.1 * 0.5; token 1: -(-1) * 1 = 1; tokens 2, 3: 0. token-mean over 4.
    log_prob = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -3.0, -4.0]], dtype=torch.float64)
    loss, metrics = policy_losses.kl_cov(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, -1.0, 0.0, 0.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 4, dtype=torch.float64),
        loss_agg_mode="token-mean",
        config=PolicyLossConfig(policy_loss={"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.1}),
    )
    assert loss.item() == pytest.approx((-math.exp(0.5) + 0.05 + 1.0) / 4)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.5 / 4)


def test_clip_cov_detaches_the_token_whose_covariance_is_in_the_band():
    # A = [2, -1, -1, 0], log_prob = [-1, -2, -2, -3] (ratio 1 everywhere): centred covariance
    # [2 * 1, 0, 0, 0]; only token 0 lies in (1, 5) and loses its gradient. token-mean gradient of
    # -A * r is -A / 4 elsewhere: [0, 0.25, 0.25, 0].
    log_prob = torch.tensor([[-1.0, -2.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_losses.clip_cov(
        old_log_prob=log_prob.detach().clone(),
        log_prob=log_prob,
        advantages=torch.tensor([[2.0, -1.0, -1.0, 0.0]], dtype=torch.float64),
        response_mask=torch.ones(1, 4, dtype=torch.float64),
        loss_agg_mode="token-mean",
        config=None,
    )
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.25, 0.25, 0.0]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_squared_error():
    # token 0: V 0.6, old 0, returns 1, clip 0.2 -> clipped V 0.2: max(0.16, 0.64) = 0.64 (clipped won)
    # token 1: V 0.1, old 0, returns 0 -> inside the range: 0.01. loss 0.5 * mean(0.64, 0.01)
    loss, metrics = value_loss(
        vpreds=torch.tensor([[0.6, 0.1]]),
        returns=torch.tensor([[1.0, 0.0]]),
        values=torch.zeros(1, 2),
        response_mask=torch.ones(1, 2),
        config={"cliprange_value": 0.2},
    )
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.01) / 2)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(0.5)


def test_a_loss_with_an_unknown_aggregation_mode_names_it():
    with pytest.raises(ValueError, match="seq-median"):
        policy_losses.cispo(**tokens([1.0], [1.0]), loss_agg_mode="seq-median", config=None)
