import pytest
import torch

from rlplat.config_node import ConfigError
from rlplat.losses import PolicyLossConfig
from rlplat.testing import PolicyLossConformance
from rlplat_plugin_template.policy_losses import truncated_is


def loss_config(**knobs):
    return PolicyLossConfig(policy_loss={"loss_mode": "example_truncated_is", **knobs})


class TestTruncatedIS(PolicyLossConformance):
    """Runs where the plugin is installed: the suite reads the loss's registration (its aggregation modes)."""

    @pytest.fixture
    def policy_loss(self):
        return truncated_is

    @pytest.fixture
    def registered_name(self):
        return "example_truncated_is"

    @pytest.fixture(params=[{}, {"ratio_cap": 1.0}])
    def policy_loss_config(self, request):
        return loss_config(**request.param)


def test_weights_above_the_cap_are_truncated_and_the_gradient_is_the_weighted_policy_gradient():
    # ratios e^0 = 1 and e^1 = 2.718..., cap 2: weights 1 and 2; token-mean over the 2 valid tokens
    old_log_prob = torch.tensor([[-1.0, -2.0, -1.0]])
    log_prob = torch.tensor([[-1.0, -1.0, -5.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = truncated_is(old_log_prob, log_prob, advantages, mask, "token-mean", loss_config(ratio_cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx((-1 * 1 * -1.0 + -2 * -1 * -1.0) / 2)
    assert log_prob.grad.tolist() == [[-0.5, 1.0, 0.0]]
    assert metrics["actor/is_truncated_frac"] == pytest.approx(0.5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.5)


def test_a_cap_that_is_not_positive_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"actor\.loss\.policy_loss.*ratio_cap must be > 0"):
        truncated_is(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "token-mean",
                     loss_config(ratio_cap=0.0))
