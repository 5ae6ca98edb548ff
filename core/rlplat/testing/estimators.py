"""Conformance suite for advantage estimators (kind ``advantage_estimator``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch


def example_inputs() -> dict[str, Any]:
    """Six responses in three groups of two, five response tokens, uneven lengths, a masked span.

    Rewards sit on the last valid token, as reward managers write them.
    """
    response_mask = torch.tensor(
        [
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 1, 0],  # a masked observation span inside the response
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.float32,
    )
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
    last_token = (response_mask * torch.arange(5)).argmax(dim=1)
    token_level_rewards = torch.zeros_like(response_mask)
    token_level_rewards[torch.arange(6), last_token] = scores
    values = torch.linspace(-0.5, 0.5, 30).reshape(6, 5) * response_mask
    index = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    return dict(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index, values=values)


class AdvantageEstimatorConformance:
    """Fixtures to provide: ``estimator`` (the callable) and ``estimator_config`` (the algorithm config
    it reads). Optional: ``estimator_extra`` (extra keyword inputs such as ``reward_baselines``; a
    tensor whose first dimension is the batch is permuted with the rows)."""

    @pytest.fixture
    def estimator_extra(self) -> dict[str, Any]:
        return {}

    def run(self, estimator, config, extra, inputs=None):
        inputs = inputs or example_inputs()
        return estimator(**inputs, config=config, **extra)

    def test_returns_float32_tensors_of_the_reward_shape(self, estimator, estimator_config, estimator_extra):
        advantages, returns = self.run(estimator, estimator_config, estimator_extra)
        for tensor in (advantages, returns):
            assert isinstance(tensor, torch.Tensor)
            assert tensor.shape == (6, 5)
            assert tensor.dtype == torch.float32
            assert torch.isfinite(tensor).all()

    def test_is_zero_where_the_response_mask_is_zero(self, estimator, estimator_config, estimator_extra):
        inputs = example_inputs()
        advantages, returns = self.run(estimator, estimator_config, estimator_extra, inputs)
        outside = inputs["response_mask"] == 0
        assert (advantages[outside] == 0).all()
        assert (returns[outside] == 0).all()

    def test_is_deterministic(self, estimator, estimator_config, estimator_extra):
        first = self.run(estimator, estimator_config, estimator_extra)
        second = self.run(estimator, estimator_config, estimator_extra)
        for a, b in zip(first, second):
            assert torch.equal(a, b)

    def test_does_not_modify_its_inputs(self, estimator, estimator_config, estimator_extra):
        inputs = example_inputs()
        copies = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in inputs.items()}
        self.run(estimator, estimator_config, estimator_extra, inputs)
        for key, value in inputs.items():
            assert np.array_equal(np.asarray(value), np.asarray(copies[key])), key

    def test_permuting_rows_permutes_the_result(self, estimator, estimator_config, estimator_extra):
        inputs = example_inputs()
        order = torch.tensor([5, 2, 0, 3, 1, 4])
        permuted = {k: (v[order] if isinstance(v, torch.Tensor) else v[order.numpy()]) for k, v in inputs.items()}
        permuted_extra = {
            k: (v[order] if isinstance(v, torch.Tensor) and v.shape[:1] == (6,) else v)
            for k, v in estimator_extra.items()
        }
        advantages, returns = self.run(estimator, estimator_config, estimator_extra, inputs)
        advantages_p, returns_p = self.run(estimator, estimator_config, permuted_extra, permuted)
        torch.testing.assert_close(advantages_p, advantages[order], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(returns_p, returns[order], rtol=1e-5, atol=1e-6)

    def test_mismatched_shapes_raise_a_value_error(self, estimator, estimator_config, estimator_extra):
        inputs = example_inputs()
        inputs["response_mask"] = inputs["response_mask"][:, :4]
        with pytest.raises(ValueError, match="shape"):
            self.run(estimator, estimator_config, estimator_extra, inputs)
