"""The policy loss ``example_truncated_is``: REINFORCE with a truncated importance weight.

It follows :class:`rlplat.contracts.algorithm.PolicyLoss` and is composed from rlplat's public loss
kit: the per-token losses are aggregated by :func:`rlplat.losses.aggregate_with_settings`, which
normalises each micro-batch by the whole mini-batch's counts, so the loss is the same however the
engine splits the batch. The actor loss around it (KL loss, entropy bonus) is rlplat's default.
"""

from __future__ import annotations

import torch

from rlplat.config_node import read_config_node
from rlplat.losses import aggregate_with_settings, masked_mean
from rlplat_plugin_template.config import TruncatedISConfig


def truncated_is(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
    """``-min(ratio, ratio_cap) * A * log_prob`` per token, the weight detached, then aggregated.

    ``ratio = exp(log_prob - old_log_prob)`` corrects for the policy having moved since the rollout
    (later mini-batches and epochs); truncating it at ``actor.loss.policy_loss.ratio_cap`` bounds the
    variance, as V-trace does (Espeholt et al., 2018). Unlike PPO's clip, every token keeps its
    gradient. Metrics: ``actor/is_truncated_frac`` (share of valid tokens whose weight was truncated)
    and ``actor/ppo_kl``.
    """
    knobs = read_config_node(config.policy_loss, TruncatedISConfig, "actor.loss.policy_loss")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0).detach()
    ratio = torch.exp(log_ratio)
    per_token = -torch.clamp(ratio, max=knobs.ratio_cap) * advantages * log_prob
    loss = aggregate_with_settings(per_token, response_mask, loss_agg_mode, config)
    metrics = {
        "actor/is_truncated_frac": float(masked_mean((ratio > knobs.ratio_cap).float(), response_mask)),
        "actor/ppo_kl": float(masked_mean(-log_ratio, response_mask)),
    }
    return loss, metrics
