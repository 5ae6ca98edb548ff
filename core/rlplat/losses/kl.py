"""KL between the actor and the reference model: per-token estimators, the KL-in-reward step with its
fixed and adaptive coefficient controllers, and the KL loss.

Estimators (Schulman, "Approximating KL divergence", 2020), with ``d = log_prob - ref_log_prob``:

=====================  ==========================================================================
``k1`` / ``kl``        ``d``
``abs``                ``|d|``
``k2`` / ``mse``       ``0.5 * d**2``
``k3`` / ``low_var_kl`` ``exp(-d) + d - 1``, with ``-d`` clamped to [-20, 20] before ``exp`` and the
                       result clamped to [-10, 10] (verl's clamps)
``<name>+``            straight-through: the value of ``<name>``, the gradient of ``k2`` (which is
                       the unbiased gradient of the KL); ``k2+`` and ``mse+`` are plain ``k2``
=====================  ==========================================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlplat.config_node import read_config_node
from rlplat.contracts.algorithm import AlgorithmConfig, KLControlConfig
from rlplat.losses.aggregation import aggregate_with_settings, masked_mean, metric
from rlplat.losses.config import PolicyLossConfig

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (see the module docstring); same shape as the inputs."""
    base = kind[:-1] if kind.endswith("+") else kind
    value = _forward_estimate(log_prob, ref_log_prob, base, kind)
    if not kind.endswith("+") or base in ("k2", "mse"):
        return value
    gradient_carrier = 0.5 * (log_prob - ref_log_prob).square()
    return gradient_carrier - gradient_carrier.detach() + value.detach()


def _forward_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, base: str, kind: str) -> torch.Tensor:
    if base in ("k1", "kl"):
        return log_prob - ref_log_prob
    if base == "abs":
        return (log_prob - ref_log_prob).abs()
    if base in ("k2", "mse"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if base in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    choices = ", ".join(KL_ESTIMATORS + tuple(k + "+" for k in KL_ESTIMATORS))
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {choices}")


class FixedKLController:
    """A constant coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing changes."""


class AdaptiveKLController:
    """Ziegler et al. (2019): ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward the one that gives ``target_kl``; ``n_steps`` is the batch's rows."""
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def build_kl_controller(config: Any = None) -> FixedKLController | AdaptiveKLController:
    """The controller ``algorithm.kl_ctrl`` describes (a :class:`KLControlConfig`, mapping or None)."""
    settings = read_config_node(config, KLControlConfig, "algorithm.kl_ctrl")
    if settings.type == "fixed":
        return FixedKLController(settings.kl_coef)
    if settings.type == "adaptive":
        return AdaptiveKLController(settings.kl_coef, settings.target_kl, settings.horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {settings.type!r}; choose 'fixed' or 'adaptive'")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    controller: FixedKLController | AdaptiveKLController,
    config: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``token_level_rewards = scores - coef * kl * mask`` with the estimator named by
    ``algorithm.kl_penalty``; then the controller is updated with the batch's KL (each sequence's masked
    mean, averaged over sequences) and ``n_steps`` = rows, as verl does.

    Returns the rewards and the metrics ``actor/reward_kl_penalty`` and ``actor/reward_kl_penalty_coeff``
    (the coefficient that was applied, before the update).
    """
    settings = read_config_node(config, AlgorithmConfig, "algorithm", strict=False)
    mask = response_mask.to(torch.float32)
    with torch.no_grad():
        kl = kl_estimate(old_log_probs, ref_log_prob, settings.kl_penalty) * mask
        coefficient = controller.value
        token_level_rewards = token_level_scores - coefficient * kl
        current_kl = torch.mean(masked_mean(kl, mask, dim=-1), dim=0).item()
    controller.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(coefficient)}
    return token_level_rewards, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the loss: the ``actor.kl_loss_type`` estimate aggregated like the policy loss, *not yet*
    multiplied by ``kl_loss_coef`` (the caller adds ``kl_loss_coef * loss``). Metric ``actor/kl_loss``."""
    settings = read_config_node(config, PolicyLossConfig, "actor.loss")
    per_token = kl_estimate(log_prob, ref_log_prob, settings.kl_loss_type)
    loss = aggregate_with_settings(per_token, response_mask, loss_agg_mode, settings)
    return loss, {"actor/kl_loss": metric(loss)}
