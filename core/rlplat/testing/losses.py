"""Conformance suite for policy losses (kind ``policy_loss``)."""

from __future__ import annotations

import pytest
import torch

from rlplat.api_version import loss_agg_modes_of
from rlplat.losses.config import LOSS_AGG_MODES, declared_loss_agg_modes
from rlplat.testing.api_levels import implementation_api


def example_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    old_log_prob = -torch.rand(3, 4, generator=generator) - 0.1
    log_prob = (old_log_prob + 0.3 * torch.randn(3, 4, generator=generator)).requires_grad_(True)
    advantages = torch.randn(3, 4, generator=generator)  # not masked: the loss must apply the mask itself
    return dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)


class PolicyLossConformance:
    """Fixtures to provide: ``policy_loss`` (the callable) and ``policy_loss_config`` (the actor config
    node it reads). Optional: ``registered_name`` (the name it is registered under: its registration's
    ``metadata={"loss_agg_modes": [...]}`` then says which modes are tested), ``plugin_api`` (the plugin
    API range it is written for; found from its plugin by default, see :mod:`rlplat.testing.api_levels`).

    Every test that takes an aggregation mode runs for the modes the loss supports: those its registration
    lists, else those of the plugin API version it declares (the four of API 1.0 when it declares none;
    ``token-sum`` from API 1.1). A mode it does not support is skipped, with the reason."""

    @pytest.fixture
    def registered_name(self) -> str | None:
        return None

    @pytest.fixture
    def plugin_api(self, policy_loss, registered_name) -> str | None:
        return implementation_api(policy_loss, "policy_loss", registered_name)

    @pytest.fixture
    def loss_agg_modes(self, registered_name, plugin_api) -> tuple[str, ...]:
        if registered_name is not None:
            from rlplat import registry

            listed = declared_loss_agg_modes(registry.entry("policy_loss", registered_name), plugin_api)
            if listed is not None:
                return listed
        return loss_agg_modes_of(plugin_api)

    def run(self, policy_loss, config, mode="token-mean", inputs=None):
        inputs = inputs or example_inputs()
        return policy_loss(**inputs, loss_agg_mode=mode, config=config)

    @staticmethod
    def skip_unless_supported(mode, loss_agg_modes, plugin_api):
        if mode not in loss_agg_modes:
            pytest.skip(f"{mode} is not asked of this loss: it supports {', '.join(loss_agg_modes)} "
                        f"(its registration's loss_agg_modes, or those of plugin API {plugin_api or '1.0'})")

    def test_supports_only_known_aggregation_modes(self, loss_agg_modes):
        assert loss_agg_modes, "a policy loss supports at least one aggregation mode"
        assert set(loss_agg_modes) <= set(LOSS_AGG_MODES), f"unknown modes: {set(loss_agg_modes) - set(LOSS_AGG_MODES)}"

    @pytest.mark.parametrize("mode", LOSS_AGG_MODES)
    def test_returns_a_finite_scalar_with_gradient_and_float_metrics(self, policy_loss, policy_loss_config, mode,
                                                                     loss_agg_modes, plugin_api):
        self.skip_unless_supported(mode, loss_agg_modes, plugin_api)
        loss, metrics = self.run(policy_loss, policy_loss_config, mode)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        assert torch.isfinite(loss)
        assert loss.requires_grad
        assert isinstance(metrics, dict)
        for key, value in metrics.items():
            assert isinstance(key, str)
            # a number: a float, or a detached 0-dim tensor (read by the engine after its micro-batch loop)
            if isinstance(value, torch.Tensor):
                assert value.dim() == 0 and not value.requires_grad and bool(torch.isfinite(value)), (
                    f"metric {key!r} is a tensor of shape {tuple(value.shape)}{' with gradient' if value.requires_grad else ''}: "
                    "a metric is a float or a detached, finite 0-dim tensor")
            else:
                assert isinstance(value, (int, float)), f"metric {key!r} is {type(value).__name__}, not a number"

    @pytest.mark.parametrize("mode", LOSS_AGG_MODES)
    def test_masked_tokens_get_no_gradient(self, policy_loss, policy_loss_config, mode, loss_agg_modes, plugin_api):
        self.skip_unless_supported(mode, loss_agg_modes, plugin_api)
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

    def test_registered_name_resolves_to_the_loss(self, policy_loss, registered_name):
        if registered_name is None:
            pytest.skip("the subclass names no registered_name")
        from rlplat import registry

        assert registry.get("policy_loss", registered_name) is policy_loss
