"""Conformance suite for policy losses (kind ``policy_loss``)."""

from __future__ import annotations

import pytest
import torch

from rlplat.losses.config import LOSS_AGG_MODES


def example_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    old_log_prob = -torch.rand(3, 4, generator=generator) - 0.1
    log_prob = (old_log_prob + 0.3 * torch.randn(3, 4, generator=generator)).requires_grad_(True)
    advantages = torch.randn(3, 4, generator=generator)  # not masked: the loss must apply the mask itself
    return dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)


class PolicyLossConformance:
    """Fixtures to provide: ``policy_loss`` (the callable) and ``policy_loss_config`` (the actor config
    node it reads)."""

    def run(self, policy_loss, config, mode="token-mean", inputs=None):
        inputs = inputs or example_inputs()
        return policy_loss(**inputs, loss_agg_mode=mode, config=config)

    @pytest.mark.parametrize("mode", LOSS_AGG_MODES)
    def test_returns_a_finite_scalar_with_gradient_and_float_metrics(self, policy_loss, policy_loss_config, mode):
        loss, metrics = self.run(policy_loss, policy_loss_config, mode)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        assert torch.isfinite(loss)
        assert loss.requires_grad
        assert isinstance(metrics, dict)
        for key, value in metrics.items():
            assert isinstance(key, str)
            assert isinstance(value, (int, float)), f"metric {key!r} is {type(value).__name__}, not a float"

    @pytest.mark.parametrize("mode", LOSS_AGG_MODES)
    def test_masked_tokens_get_no_gradient(self, policy_loss, policy_loss_config, mode):
        inputs = example_inputs()
        loss, _ = self.run(policy_loss, policy_loss_config, mode, inputs)
        loss.backward()
        gradient = inputs["log_prob"].grad
        assert gradient is not None
        assert (gradient[inputs["response_mask"] == 0] == 0).all()

    def test_is_deterministic(self, policy_loss, policy_loss_config):
        first, _ = self.run(policy_loss, policy_loss_config)
        second, _ = self.run(policy_loss, policy_loss_config)
        assert torch.equal(first.detach(), second.detach())

    def test_does_not_modify_its_inputs(self, policy_loss, policy_loss_config):
        inputs = example_inputs()
        copies = {k: v.detach().clone() for k, v in inputs.items()}
        self.run(policy_loss, policy_loss_config, inputs=inputs)
        for key, value in inputs.items():
            assert torch.equal(value.detach(), copies[key]), key

    def test_unknown_aggregation_mode_raises_a_value_error_naming_it(self, policy_loss, policy_loss_config):
        with pytest.raises(ValueError, match="token-median"):
            self.run(policy_loss, policy_loss_config, mode="token-median")
