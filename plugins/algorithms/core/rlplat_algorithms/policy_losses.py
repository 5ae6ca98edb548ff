"""Policy losses, numerically those of verl's ``core_algos`` (registered names in brackets).

Every loss has the contract's signature
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) -> (loss, metrics)``;
``config`` is the ``actor.loss`` node (:class:`rlplat.losses.PolicyLossConfig`, a mapping or
None); the covariance losses read their knobs from its ``policy_loss`` node
(:class:`~rlplat_algorithms.config.LossModeConfig`). The per-token loss matrix is aggregated with
:func:`~rlplat_algorithms.aggregation.aggregate_loss`, normalised by the config's
``global_token_count`` / ``global_sequence_count`` when the engine provides them. Metrics are python
floats under verl's names (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``).

``ratio = exp(log_prob - old_log_prob)``; where verl clamps the log-ratio to [-20, 20] before
``exp`` (vanilla, CISPO) so does rlplat, and where it does not (Clip-Cov, KL-Cov, REINFORCE) neither
does rlplat.
"""

from __future__ import annotations

from typing import Any

import torch

from rlplat.config_node import read_config_node
from rlplat.losses.aggregation import aggregate_with_settings, masked_mean, metric
from rlplat.losses.config import LOSS_AGG_MODES, PolicyLossConfig
from rlplat_algorithms.config import LossModeConfig


def _settings(config: Any, loss_agg_mode: str) -> PolicyLossConfig:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    return read_config_node(config, PolicyLossConfig, "actor.loss")


def _clip_range(settings: PolicyLossConfig) -> tuple[float, float]:
    low = settings.clip_ratio if settings.clip_ratio_low is None else settings.clip_ratio_low
    high = settings.clip_ratio if settings.clip_ratio_high is None else settings.clip_ratio_high
    return low, high


def _knobs(settings: PolicyLossConfig) -> LossModeConfig:
    return read_config_node(settings.policy_loss, LossModeConfig, "actor.loss.policy_loss")




def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    """PPO's clipped surrogate with separate low/high clip ranges and dual clip.

    ``max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` it is then
    capped at ``-A * clip_ratio_c`` (Ye et al., 2019). ``actor/pg_clipfrac`` counts tokens where the
    clipped term won, ``actor/pg_clipfrac_lower`` those where the dual clip bound (A < 0 only).
    """
    settings = _settings(config, loss_agg_mode)
    low, high = _clip_range(settings)
    if settings.clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c (the dual-clip bound) must be > 1.0, got {settings.clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    surrogate = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * settings.clip_ratio_c
    dual_clipped = torch.min(dual_bound, surrogate)
    pg_losses = torch.where(advantages < 0, dual_clipped, surrogate)
    loss = aggregate_with_settings(pg_losses, response_mask, loss_agg_mode, settings)
    metrics = {
        "actor/pg_clipfrac": metric(masked_mean(torch.gt(clipped, unclipped).float(), response_mask)),
        "actor/ppo_kl": metric(masked_mean(-log_ratio, response_mask)),
        "actor/pg_clipfrac_lower": metric(
            masked_mean(torch.gt(surrogate, dual_bound).float() * (advantages < 0).float(), response_mask)
        ),
    }
    return loss, metrics


def gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None):
    """GSPO (Zheng et al., 2025): a sequence-level ratio ``s = exp(mean over valid tokens of log r)``,
    applied per token as ``sg(s) * pi / sg(pi)`` (log clamped at 10), clipped PPO-style.

    The loss is aggregated by ``loss_agg_mode``, as in verl 0.9.1; the paper's (and the ``gspo``
    algorithm's default) is ``seq-mean-token-mean``.
    """
    settings = _settings(config, loss_agg_mode)
    low, high = _clip_range(settings)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    lengths = mask.sum(dim=-1).clamp(min=1)
    sequence_log_ratio = (log_ratio * mask).sum(dim=-1) / lengths
    token_log_ratio = log_prob - log_prob.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(unclipped, clipped)
    loss = aggregate_with_settings(pg_losses, response_mask, loss_agg_mode, settings)
    metrics = {
        "actor/pg_clipfrac": metric(masked_mean(torch.gt(clipped, unclipped).float(), response_mask)),
        "actor/ppo_kl": metric(masked_mean(-log_ratio, response_mask)),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


def cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    """CISPO (MiniMax, 2025): ``-sg(clip(r, 1 - low, 1 + high)) * A * log_prob`` — the importance
    weight is clipped and detached, so every token keeps a gradient."""
    settings = _settings(config, loss_agg_mode)
    low, high = _clip_range(settings)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    loss = aggregate_with_settings(pg_losses, response_mask, loss_agg_mode, settings)
    metrics = {
        "actor/pg_clipfrac": metric(masked_mean((ratio != clipped_ratio).float(), response_mask)),
        "actor/ppo_kl": metric(masked_mean(-log_ratio, response_mask)),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


def clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    """Clip-Cov (Cui et al., 2025): the PPO clipped loss, with the gradient removed from a random
    ``clip_cov_ratio`` share of the valid, unclipped tokens whose centred covariance
    ``(A - mean A) * (log_prob - mean log_prob)`` lies in ``(clip_cov_lb, clip_cov_ub)``.

    The random pick uses torch's global generator, as verl does (reproducible under ``torch.manual_seed``).
    ``actor/pg_clipfrac`` is the share of tokens whose gradient was removed.
    """
    settings = _settings(config, loss_agg_mode)
    knobs = _knobs(settings)
    if knobs.clip_cov_ratio <= 0:
        raise ValueError(f"actor.loss.policy_loss.clip_cov_ratio must be > 0, got {knobs.clip_cov_ratio}")
    low, high = _clip_range(settings)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = response_mask > 0
    clipped_by_ppo = (clipped > unclipped) & valid
    covariance = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    covariance = covariance.masked_fill(~valid | clipped_by_ppo, -torch.inf)
    quota = max(int(knobs.clip_cov_ratio * response_mask.sum().item()), 1)
    candidates = torch.nonzero((covariance < knobs.clip_cov_ub) & (covariance > knobs.clip_cov_lb) & valid)
    if len(candidates) > 0:
        candidates = candidates[torch.randperm(len(candidates))[: min(quota, len(candidates))]]
    keep_gradient = torch.ones_like(advantages)
    keep_gradient[candidates[:, 0], candidates[:, 1]] = 0
    pg_losses = torch.maximum(unclipped, clipped) * keep_gradient
    loss = aggregate_with_settings(pg_losses, response_mask, loss_agg_mode, settings)
    metrics = {
        "actor/pg_clipfrac": metric(masked_mean((keep_gradient == 0).float(), response_mask)),
        "actor/ppo_kl": metric(masked_mean(-log_ratio, response_mask)),
    }
    return loss, metrics


def kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    """KL-Cov (Cui et al., 2025): the unclipped surrogate ``-A * r``, plus ``ppo_kl_coef * |log r|`` on
    the ``kl_cov_ratio`` share (at least one) of valid tokens with the largest centred covariance of
    advantage and log-prob. ``actor/ppo_kl`` is the masked mean of ``|log r|`` here, as in verl."""
    settings = _settings(config, loss_agg_mode)
    knobs = _knobs(settings)
    if knobs.kl_cov_ratio <= 0:
        raise ValueError(f"actor.loss.policy_loss.kl_cov_ratio must be > 0, got {knobs.kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    with_kl = surrogate + knobs.ppo_kl_coef * log_ratio.abs()
    valid = response_mask > 0
    selected = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
    valid_positions = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(valid_positions) > 0:
        valid_advantages = advantages[valid].detach().reshape(-1).cpu()
        valid_log_probs = log_prob[valid].detach().reshape(-1).cpu()
        covariance = (valid_advantages - valid_advantages.mean()) * (valid_log_probs - valid_log_probs.mean())
        count = max(1, int(len(covariance) * knobs.kl_cov_ratio))
        largest = torch.topk(covariance, count, largest=True).indices
        selected[valid_positions[largest.to(valid_positions.device)]] = True
    pg_losses = torch.where(selected.reshape(advantages.shape), with_kl, surrogate)
    loss = aggregate_with_settings(pg_losses, response_mask, loss_agg_mode, settings)
    return loss, {"actor/ppo_kl": metric(masked_mean(log_ratio.abs(), response_mask))}


def reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    """Plain policy gradient, no ratio and no clipping: ``-A * log_prob`` (verl's REINFORCE loss
    without rollout importance weights). ``actor/ppo_kl`` is still reported for monitoring."""
    settings = _settings(config, loss_agg_mode)
    pg_losses = -advantages * log_prob
    loss = aggregate_with_settings(pg_losses, response_mask, loss_agg_mode, settings)
    return loss, {"actor/ppo_kl": metric(masked_mean(-(log_prob - old_log_prob), response_mask))}
