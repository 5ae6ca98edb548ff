"""KL estimators, KL in the reward with its controllers, KL loss and entropy bonus."""

import math

import pytest
import torch

from rlplat.losses import kl
from rlplat.losses import PolicyLossConfig
from rlplat.losses.functions import ActorLoss
from rlplat_algorithms.policy_losses import reinforce

# d = log_prob - ref_log_prob = +0.5 and -0.5
LOG_PROB = torch.tensor([-1.0, -1.5], dtype=torch.float64)
REF_LOG_PROB = torch.tensor([-1.5, -1.0], dtype=torch.float64)


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("k1", "kl"), [0.5, -0.5]),  # d
        (("abs",), [0.5, 0.5]),  # |d|
        (("k2", "mse"), [0.125, 0.125]),  # d^2 / 2
        (("k3", "low_var_kl"), [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]),  # e^-d + d - 1
    ],
)
def test_estimator_values(kinds, expected):
    for kind in kinds:
        assert kl.kl_estimate(LOG_PROB, REF_LOG_PROB, kind).tolist() == pytest.approx(expected)


def test_k3_is_clamped_as_in_verl():
    # d = -30: the log ratio 30 is clamped to 20, exp(20) - 20 - 1 is then clamped to 10
    value = kl.kl_estimate(torch.tensor([-31.0]), torch.tensor([-1.0]), "k3")
    assert value.item() == 10.0


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_straight_through_variants_have_the_value_of_the_base_and_the_gradient_of_k2(kind):
    log_prob = LOG_PROB.clone().requires_grad_()
    value = kl.kl_estimate(log_prob, REF_LOG_PROB, kind)
    torch.testing.assert_close(value.detach(), kl.kl_estimate(LOG_PROB, REF_LOG_PROB, kind[:-1]))
    value.sum().backward()
    torch.testing.assert_close(log_prob.grad, LOG_PROB - REF_LOG_PROB)  # d/d log_prob of d^2 / 2


def test_unknown_estimator_lists_the_choices():
    with pytest.raises(ValueError, match="k3"):
        kl.kl_estimate(LOG_PROB, REF_LOG_PROB, "k4")


def test_kl_in_the_reward_subtracts_coefficient_times_kl_on_valid_tokens():
    # k1 with old - ref = [0.5, 0, -0.5, 9] and the last token masked; coefficient 0.1:
    # rewards [0 - 0.05, 0, 1 + 0.05, 0]; batch KL = mean of the row's masked mean = 0
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -10.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    controller = kl.build_kl_controller({"type": "fixed", "kl_coef": 0.1})
    rewards, metrics = kl.apply_kl_penalty(scores, old, ref, mask, controller, {"kl_penalty": "k1"})
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)


def test_fixed_controller_keeps_its_coefficient():
    controller = kl.build_kl_controller({"type": "fixed", "kl_coef": 0.2})
    controller.update(current_kl=5.0, n_steps=100)
    assert controller.value == 0.2


def test_adaptive_controller_moves_by_the_clipped_proportional_error():
    # KL 0.2 vs target 0.1: error clip(1, -0.2, 0.2) = 0.2; 10 samples over horizon 100 -> x (1 + 0.02)
    controller = kl.build_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 100})
    controller.update(current_kl=0.2, n_steps=10)
    assert controller.value == pytest.approx(0.102)
    controller.update(current_kl=0.05, n_steps=10)  # error -0.5 clipped to -0.2 -> x (1 - 0.02)
    assert controller.value == pytest.approx(0.102 * 0.98)


def test_controller_configuration_errors_are_explained():
    with pytest.raises(ValueError, match="fixed"):
        kl.build_kl_controller({"type": "pid"})
    with pytest.raises(ValueError, match="horizon"):
        kl.build_kl_controller({"type": "adaptive", "horizon": 0})


def test_kl_loss_aggregates_the_configured_estimator():
    # k2 of d = [0.5, -0.5] is 0.125 per token; token-mean 0.125
    loss, metrics = kl.kl_loss(LOG_PROB[None], REF_LOG_PROB[None], torch.ones(1, 2), "token-mean", {"kl_loss_type": "mse"})
    assert loss.item() == pytest.approx(0.125)
    assert metrics["actor/kl_loss"] == pytest.approx(0.125)


class MicroBatch:
    def __init__(self, batch):
        self.batch, self.meta_info = batch, {}


def test_actor_loss_adds_the_kl_loss_and_subtracts_the_entropy_bonus():
    # reinforce: -A * log_prob = -1 * -1 = 1 per token; entropy 2 per token times 0.01; k1 KL 0.5 times 0.1
    batch = {
        "response_mask": torch.ones(1, 2),
        "old_log_probs": torch.full((1, 2), -1.0),
        "advantages": torch.ones(1, 2),
        "ref_log_prob": torch.full((1, 2), -1.5),
    }
    config = PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    loss, metrics = ActorLoss(config, policy_loss=reinforce)(
        {"log_probs": torch.full((1, 2), -1.0), "entropy": torch.full((1, 2), 2.0)}, MicroBatch(batch)
    )
    assert loss.item() == pytest.approx(1.0 - 0.01 * 2.0 + 0.1 * 0.5)
    assert metrics["actor/pg_loss"] == pytest.approx(1.0)
    assert metrics["actor/entropy"] == pytest.approx(2.0)
    assert metrics["actor/kl_loss"] == pytest.approx(0.5)


def test_actor_loss_finds_its_policy_loss_in_the_registry():
    assert ActorLoss({"policy_loss": {"loss_mode": "cispo"}}).policy_loss.__name__ == "cispo"
