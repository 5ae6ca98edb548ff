import numpy as np
import pytest
import torch

from rlplat.contracts.algorithm import AlgorithmConfig
from rlplat.testing import AdvantageEstimatorConformance
from rlplat_plugin_template.estimators import group_median


class TestGroupMedian(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self):
        return group_median

    @pytest.fixture
    def estimator_config(self):
        return AlgorithmConfig(adv_estimator="example_group_median")


def test_each_response_gets_its_score_minus_its_groups_median_on_its_valid_tokens():
    # group a: scores 1, 0, 0 -> median 0; group b: scores 1, 0 -> median 0.5; group c: one response -> 0
    rewards = torch.tensor([[0, 1.0], [0, 0], [0, 0], [0.0, 1], [0, 0], [0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    advantages, returns = group_median(rewards, mask, index)
    expected = torch.tensor([[1.0, 1], [0, 0], [0, 0], [0.5, 0.5], [-0.5, -0.5], [0, 0]])
    assert torch.equal(advantages, expected)
    assert torch.equal(returns, expected)


def test_one_lucky_response_keeps_the_whole_credit():
    rewards = torch.tensor([[1.0]] + [[0.0]] * 7)
    advantages, _ = group_median(rewards, torch.ones(8, 1), np.array(["a"] * 8, dtype=object))
    assert advantages.squeeze(-1).tolist() == [1.0] + [0.0] * 7
