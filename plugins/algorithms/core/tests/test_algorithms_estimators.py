"""Advantage estimators against numbers worked out by hand (each test says how)."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlplat_algorithms import estimators
from rlplat.contracts.algorithm import AlgorithmConfig


def outcome_batch(scores, lengths, width=4):
    """Rows whose single reward sits on the last of ``lengths`` valid tokens, as reward managers write it."""
    mask = torch.zeros(len(scores), width)
    rewards = torch.zeros(len(scores), width)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        mask[row, :length] = 1
        rewards[row, length - 1] = score
    return rewards, mask


def group_ids(*ids):
    return np.array(ids, dtype=object)


def test_grpo_divides_by_the_unbiased_group_std_plus_epsilon():
    # group a = [1, 0, 0.5]: mean 0.5; unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    rewards, mask = outcome_batch([1.0, 0.0, 0.5], [2, 3, 1])
    advantages, returns = estimators.grpo(rewards, mask, group_ids("a", "a", "a"))
    expected = torch.tensor([0.5, -0.5, 0.0]) / (0.5 + 1e-6)
    torch.testing.assert_close(advantages, expected[:, None] * mask)
    torch.testing.assert_close(returns, advantages)


def test_grpo_gives_a_group_of_one_mean_zero_and_std_one():
    # verl's choice: a lone response's advantage is score / (1 + 1e-6)
    rewards, mask = outcome_batch([0.7, 1.0, 0.0], [2, 1, 1])
    advantages, _ = estimators.grpo(rewards, mask, group_ids("alone", "pair", "pair"))
    assert advantages[0, 0].item() == pytest.approx(0.7 / (1 + 1e-6), rel=1e-6)
    assert advantages[0, 1].item() == pytest.approx(0.7 / (1 + 1e-6), rel=1e-6)


def test_grpo_without_std_normalisation_reads_the_flag_from_any_config_form():
    # [1, 0] centred: [0.5, -0.5]; same from a dataclass, a dict and an OmegaConf node
    rewards, mask = outcome_batch([1.0, 0.0], [1, 1])
    for config in (AlgorithmConfig(norm_adv_by_std_in_grpo=False), {"norm_adv_by_std_in_grpo": False},
                   OmegaConf.create({"norm_adv_by_std_in_grpo": False, "unrelated": 3})):
        advantages, _ = estimators.grpo(rewards, mask, group_ids("g", "g"), config=config)
        assert advantages[:, 0].tolist() == [0.5, -0.5]


def test_dr_grpo_never_divides_by_the_std():
    # [1, 0, 0.5] - 0.5, even when the config asks for std normalisation
    rewards, mask = outcome_batch([1.0, 0.0, 0.5], [1, 1, 1])
    advantages, _ = estimators.dr_grpo(rewards, mask, group_ids("a", "a", "a"), config={"norm_adv_by_std_in_grpo": True})
    assert advantages[:, 0].tolist() == [0.5, -0.5, 0.0]


def test_rloo_subtracts_the_mean_of_the_other_responses_and_keeps_a_lone_score():
    # 1 - mean(0, 0.5) = 0.75, 0 - mean(1, 0.5) = -0.75, 0.5 - mean(1, 0) = 0; the lone 0.7 stays 0.7
    rewards, mask = outcome_batch([1.0, 0.0, 0.5, 0.7], [1, 1, 1, 1])
    advantages, _ = estimators.rloo(rewards, mask, group_ids("a", "a", "a", "b"))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.75, -0.75, 0.0, 0.7]))


def test_opo_uses_the_length_weighted_group_mean_as_baseline():
    # lengths 1 and 3, scores 1 and 0: baseline (1*1 + 3*0) / 4 = 0.25
    rewards, mask = outcome_batch([1.0, 0.0], [1, 3])
    advantages, _ = estimators.opo(rewards, mask, group_ids("a", "a"))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.75, -0.25]))


def test_gpg_scales_centred_scores_by_batch_size_over_non_zero_scores():
    # scores [1, 0, 1, 1]: alpha = 4 / 3; group a centred [0.5, -0.5], group b centred [0, 0]
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 1.0], [1, 1, 1, 1])
    advantages, _ = estimators.gpg(rewards, mask, group_ids("a", "a", "b", "b"))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([2 / 3, -2 / 3, 0.0, 0.0]))


def test_grpo_passk_rewards_only_the_best_response_by_its_margin():
    # [0.2, 1.0, 0.5]: margin 1.0 - 0.5; unbiased std of the group = sqrt(0.326667 / 2)
    rewards, mask = outcome_batch([0.2, 1.0, 0.5], [1, 1, 1])
    advantages, _ = estimators.grpo_passk(rewards, mask, group_ids("a", "a", "a"))
    std = math.sqrt(((0.2 - 17 / 30) ** 2 + (1.0 - 17 / 30) ** 2 + (0.5 - 17 / 30) ** 2) / 2)
    assert advantages[:, 0].tolist() == pytest.approx([0.0, 0.5 / (std + 1e-6), 0.0], rel=1e-5)


def test_grpo_passk_refuses_a_group_of_one():
    rewards, mask = outcome_batch([1.0], [1])
    with pytest.raises(ValueError, match="at least 2"):
        estimators.grpo_passk(rewards, mask, group_ids("a"))


def test_reinforce_plus_plus_discounts_then_whitens_over_valid_tokens():
    # gamma 0.5: row 0 rewards [0, 0, 1] -> returns [0.25, 0.5, 1]; row 1 [0, 2] -> [1, 2].
    # valid returns .25 .5 1 1 2: mean 0.95, unbiased var 1.8 / 4 = 0.45
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = estimators.reinforce_plus_plus(rewards, mask, None, config={"gamma": 0.5})
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    expected = (torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.95]]) - 0.95) / math.sqrt(0.45 + 1e-8) * mask
    torch.testing.assert_close(advantages, expected)


def test_reinforce_plus_plus_skips_a_masked_span_instead_of_restarting():
    # mask [1, 0, 1], gamma 0.5, reward 1 at the end and 9 inside the span: the first token's
    # return is 0.5 * 1 (verl would restart at the span and give 0 there)
    rewards = torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    _, returns = estimators.reinforce_plus_plus(rewards, mask, None, config={"gamma": 0.5})
    assert returns[0].tolist() == [0.5, 0.0, 1.0]


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_tokens():
    # group [1, 0] -> [0.5, -0.5] on 2 and 1 tokens: values .5 .5 -.5, mean 1/6,
    # unbiased var ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3
    rewards, mask = outcome_batch([1.0, 0.0], [2, 1], width=2)
    advantages, _ = estimators.reinforce_plus_plus_baseline(rewards, mask, group_ids("a", "a"))
    scale = 1 / math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(advantages, torch.tensor([[1 / 3, 1 / 3], [-2 / 3, 0.0]]) * scale)


def test_remax_subtracts_the_greedy_score_from_the_return_to_go():
    # return-to-go of [0, 0, 1] is [1, 1, 1]; minus the baseline 0.4 on every valid token
    rewards, mask = outcome_batch([1.0, 0.0], [3, 2], width=3)
    advantages, returns = estimators.remax(rewards, mask, None, reward_baselines=torch.tensor([0.4, 0.5]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.6, 0.6, 0.6], [-0.5, -0.5, 0.0]]))


def test_remax_without_baselines_says_what_it_needs():
    rewards, mask = outcome_batch([1.0], [1])
    with pytest.raises(ValueError, match="reward_baselines"):
        estimators.remax(rewards, mask, None)


def test_gae_with_gamma_and_lambda_one_returns_the_reward_to_go():
    # values [.1, .2, .3], reward 1 at the end: A = [0.9, 0.8, 0.7], returns A + V = [1, 1, 1];
    # whitening: mean 0.8, unbiased var 0.01 -> [1, 0, -1] (up to the 1e-8 in the rsqrt)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    values = torch.tensor([[0.1, 0.2, 0.3]])
    advantages, returns = estimators.gae(rewards, mask, None, values=values, config={"gamma": 1.0, "lam": 1.0})
    torch.testing.assert_close(returns, torch.ones(1, 3))
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 0.0, -1.0]]), atol=1e-5, rtol=0)


def test_gae_discounts_with_gamma_and_lambda():
    # gamma = lam = 0.5: delta2 = 1 - .3 = .7; delta1 = .5*.3 - .2 = -.05, A1 = -.05 + .25*.7 = .125;
    # delta0 = .5*.2 - .1 = 0, A0 = .25 * .125 = .03125; returns = A + V
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3]])
    _, returns = estimators.gae(rewards, torch.ones(1, 3), None, values=values, config={"gamma": 0.5, "lam": 0.5})
    torch.testing.assert_close(returns, torch.tensor([[0.13125, 0.325, 1.0]]))


def test_gae_is_invariant_to_masked_spans_inserted_in_a_response():
    # a tool span (mask 0, arbitrary values and rewards) between tokens 1 and 2 changes nothing on valid tokens
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0]])
    values = torch.tensor([[0.1, 0.4, -0.2, 0.3], [0.2, -0.1, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    span = 3
    with_span = {
        name: torch.cat([tensor[:, :2], fill, tensor[:, 2:]], dim=1)
        for name, tensor, fill in (
            ("rewards", rewards, torch.full((2, span), 7.0)),
            ("values", values, torch.full((2, span), -5.0)),
            ("mask", mask, torch.zeros(2, span)),
        )
    }
    config = {"gamma": 0.9, "lam": 0.8}
    advantages, returns = estimators.gae(rewards, mask, None, values=values, config=config)
    advantages_span, returns_span = estimators.gae(
        with_span["rewards"], with_span["mask"], None, values=with_span["values"], config=config
    )
    valid = torch.cat([torch.arange(2), torch.arange(2 + span, 4 + span)])
    torch.testing.assert_close(advantages_span[:, valid], advantages)
    torch.testing.assert_close(returns_span[:, valid], returns)
    assert (advantages_span[:, 2 : 2 + span] == 0).all() and (returns_span[:, 2 : 2 + span] == 0).all()


def test_gae_without_values_says_it_needs_a_critic():
    rewards, mask = outcome_batch([1.0], [1])
    with pytest.raises(ValueError, match="critic"):
        estimators.gae(rewards, mask, None)


def test_an_index_of_the_wrong_length_is_a_shape_error():
    rewards, mask = outcome_batch([1.0, 0.0], [1, 1])
    with pytest.raises(ValueError, match="shape"):
        estimators.grpo(rewards, mask, group_ids("a"))
