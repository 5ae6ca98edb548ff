"""The critic's clipped value loss (PPO), as verl's ``core_algos.compute_value_loss``."""

from __future__ import annotations

from typing import Any

import torch

from rlplat.config_node import read_config_node
from rlplat.losses.aggregation import aggregate_with_settings, masked_mean, metric
from rlplat.losses.config import ValueLossConfig


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str | None = None,
    config: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * aggregate(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.

    ``vpreds`` are the critic's new predictions (with gradient), ``values`` those it made when the
    batch was collected, ``returns`` the targets, ``c`` = ``critic.cliprange_value``. ``loss_agg_mode``
    defaults to the config's. Metrics: ``critic/vf_loss`` and ``critic/vf_clipfrac`` (share of valid
    tokens where the clipped term was larger).
    """
    settings = read_config_node(config, ValueLossConfig, "critic.loss")
    mode = settings.loss_agg_mode if loss_agg_mode is None else loss_agg_mode
    clipped_vpreds = torch.max(
        torch.min(vpreds, values + settings.cliprange_value), values - settings.cliprange_value
    )
    unclipped_losses = (vpreds - returns) ** 2
    clipped_losses = (clipped_vpreds - returns) ** 2
    loss = 0.5 * aggregate_with_settings(torch.max(unclipped_losses, clipped_losses), response_mask, mode, settings)
    clipfrac = masked_mean(torch.gt(clipped_losses, unclipped_losses).float(), response_mask)
    return loss, {"critic/vf_loss": metric(loss), "critic/vf_clipfrac": metric(clipfrac)}
