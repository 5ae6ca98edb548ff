"""The per-micro-batch loss functions an engine's ``train_batch`` calls (see
:class:`rlplat.contracts.engine.LossFunction`): the actor's (policy loss, KL loss, entropy bonus) and
the critic's (clipped value loss).

Both read ``global_token_count`` / ``global_sequence_count`` from ``micro_batch.meta_info``, so the
engine, which sums gradients over micro-batches and ranks, gets the gradient of the unsplit
mini-batch. They are plain picklable objects, built on the driver and shipped to workers.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from rlplat_algorithms.aggregation import aggregate_with_settings
from rlplat_algorithms.config import PolicyLossConfig, ValueLossConfig, read_config, with_global_counts
from rlplat_algorithms.kl import kl_loss
from rlplat_algorithms.value_loss import value_loss


def as_contributions(metrics: dict[str, float], additive: set[str], share: float) -> dict[str, float]:
    """Metrics as the engine sums them: globally normalised ones (``additive``) as they are, means over
    this micro-batch's tokens scaled by its ``share`` of the mini-batch's tokens."""
    return {key: value if key in additive else value * share for key, value in metrics.items()}


def token_share(response_mask: torch.Tensor, global_token_count: Any) -> float:
    """This micro-batch's fraction of the mini-batch's valid tokens (1 when no global count is given)."""
    if not global_token_count:
        return 1.0
    return float(response_mask.sum()) / float(global_token_count)


class ActorLoss:
    """``policy_loss - entropy_coeff * entropy + kl_loss_coef * KL(actor || reference)``.

    ``config`` is the ``actor`` node; ``policy_loss`` a callable of kind ``policy_loss`` (default: the
    registry entry named by ``config.policy_loss.loss_mode``). Reads ``response_mask``,
    ``old_log_probs``, ``advantages`` and, with ``use_kl_loss``, ``ref_log_prob`` from the micro-batch;
    ``log_probs`` and, with ``entropy_coeff != 0``, ``entropy`` from the engine's outputs.
    Metrics add ``actor/pg_loss``, ``actor/entropy`` and ``actor/kl_loss`` / ``actor/kl_coef`` when used.
    """

    def __init__(self, config: Any = None, policy_loss: Callable[..., Any] | None = None):
        self.config = read_config(config, PolicyLossConfig, where="actor")
        if policy_loss is None:
            from rlplat import registry

            policy_loss = registry.get("policy_loss", self.config.policy_loss.loss_mode)
        self.policy_loss = policy_loss

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        settings = with_global_counts(self.config, PolicyLossConfig, micro_batch.meta_info)
        batch = micro_batch.batch
        response_mask, log_prob = batch["response_mask"], outputs["log_probs"]
        loss, metrics = self.policy_loss(
            batch["old_log_probs"], log_prob, batch["advantages"], response_mask, settings.loss_agg_mode, settings
        )
        metrics = {**metrics, "actor/pg_loss": float(loss.detach().item())}
        if settings.entropy_coeff != 0:
            entropy = aggregate_with_settings(outputs["entropy"], response_mask, settings.loss_agg_mode, settings)
            loss = loss - settings.entropy_coeff * entropy
            metrics["actor/entropy"] = float(entropy.detach().item())
        if settings.use_kl_loss:
            kl, kl_metrics = kl_loss(log_prob, batch["ref_log_prob"], response_mask, settings.loss_agg_mode, settings)
            loss = loss + settings.kl_loss_coef * kl
            metrics.update(kl_metrics)
            metrics["actor/kl_coef"] = float(settings.kl_loss_coef)
        additive = {"actor/pg_loss", "actor/entropy", "actor/kl_loss"}
        return loss, as_contributions(metrics, additive, token_share(response_mask, settings.global_token_count))


class CriticLoss:
    """The clipped value loss of :func:`~rlplat_algorithms.value_loss.value_loss` for one micro-batch.

    Reads ``response_mask``, ``values`` (old predictions) and ``returns`` from the micro-batch and
    ``values`` (new predictions, with gradient) from the engine's outputs.
    """

    def __init__(self, config: Any = None):
        self.config = read_config(config, ValueLossConfig, where="critic")

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        settings = with_global_counts(self.config, ValueLossConfig, micro_batch.meta_info)
        batch = micro_batch.batch
        loss, metrics = value_loss(outputs["values"], batch["returns"], batch["values"], batch["response_mask"], None, settings)
        additive = {"critic/vf_loss"}
        return loss, as_contributions(metrics, additive, token_share(batch["response_mask"], settings.global_token_count))
