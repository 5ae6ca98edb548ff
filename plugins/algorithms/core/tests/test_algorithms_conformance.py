"""Every registered estimator, policy loss and algorithm spec passes the conformance suite of its kind."""

import pytest
import torch

from rlplat import registry
from rlplat.testing import AdvantageEstimatorConformance, AlgorithmConformance, PolicyLossConformance
from rlplat.contracts.algorithm import AlgorithmConfig
from rlplat.losses import PolicyLossConfig
from rlplat_algorithms.plugin import ADVANTAGE_ESTIMATORS, ALGORITHMS, POLICY_LOSSES


class TestAdvantageEstimators(AdvantageEstimatorConformance):
    @pytest.fixture(params=sorted(ADVANTAGE_ESTIMATORS))
    def estimator_name(self, request):
        return request.param

    @pytest.fixture
    def estimator(self, estimator_name):
        return registry.get("advantage_estimator", estimator_name)

    @pytest.fixture
    def estimator_config(self):
        return AlgorithmConfig(gamma=0.9, lam=0.95)

    @pytest.fixture
    def estimator_extra(self, estimator_name):
        if estimator_name == "remax":
            return {"reward_baselines": torch.tensor([0.5, 0.5, 0.25, 0.25, 0.0, 0.0])}
        return {}


class TestPolicyLosses(PolicyLossConformance):
    @pytest.fixture(params=sorted(POLICY_LOSSES))
    def registered_name(self, request):
        return request.param

    @pytest.fixture
    def policy_loss(self, registered_name):
        return registry.get("policy_loss", registered_name)

    @pytest.fixture
    def policy_loss_config(self):
        return PolicyLossConfig(clip_ratio_high=0.28)


class TestAlgorithms(AlgorithmConformance):
    @pytest.fixture(params=sorted(ALGORITHMS))
    def registered_name(self, request):
        return request.param

    @pytest.fixture
    def algorithm(self, registered_name):
        return registry.get("algorithm", registered_name)()
