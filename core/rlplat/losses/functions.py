"""The per-micro-batch loss functions an engine's ``train_batch`` calls (see
:class:`rlplat.contracts.engine.LossFunction`): the actor's (policy loss, KL loss, entropy bonus) and
the critic's (clipped value loss), and the rule that turns a loss's metrics into contributions.

Both read ``global_token_count`` / ``global_sequence_count`` from ``micro_batch.meta_info``, so the
engine, which sums gradients over micro-batches and ranks, gets the gradient of the unsplit
mini-batch. They are plain picklable objects: built in the worker from the config node, or built in
the driver and shipped to the workers by value (``update_actor(batch, loss_fn=...)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, TypeVar

import torch

from rlplat.config_node import ConfigError, read_config_node
from rlplat.losses.aggregation import aggregate_with_settings, metric, metrics_deferred
from rlplat.losses.config import ENGINE_SET_KEYS, PolicyLossConfig, ValueLossConfig
from rlplat.losses.kl import kl_loss
from rlplat.losses.value import value_loss

ConfigT = TypeVar("ConfigT")


def with_global_counts(settings: ConfigT, meta_info: Mapping[str, Any]) -> ConfigT:
    """``settings`` (a loss config dataclass) with ``global_token_count`` / ``global_sequence_count``
    taken from a micro-batch's ``meta_info``, where the engine puts them (keys of the same names)."""
    counts = {key: meta_info[key] for key in ENGINE_SET_KEYS if meta_info.get(key) is not None}
    return dataclasses.replace(settings, **counts) if counts else settings


def token_share(response_mask: torch.Tensor, global_token_count: Any) -> float:
    """This micro-batch's fraction of the mini-batch's valid tokens (1 when no global count is given)."""
    if not global_token_count:
        return 1.0
    return float(response_mask.sum()) / float(global_token_count)


def sequence_share(response_mask: torch.Tensor, global_sequence_count: Any) -> float:
    """This micro-batch's fraction of the mini-batch's rows with a valid token (1 when no global count is given)."""
    if not global_sequence_count:
        return 1.0
    return float((response_mask.sum(-1) > 0).sum()) / float(global_sequence_count)


def metric_share(response_mask: torch.Tensor, global_token_count: Any) -> Any:
    """:func:`token_share`, inside :func:`~rlplat.losses.aggregation.deferred_metrics` as a 0-dim float64 tensor on the
    mask's device (no wait on it); a metric times it is what it is times :func:`token_share`, to the last bit (the
    count is exact in float64, the division float64 either way)."""
    if not global_token_count or not metrics_deferred():
        return token_share(response_mask, global_token_count)
    return response_mask.sum().double() / float(global_token_count)


def as_contributions(metrics: Mapping[str, float], additive: set[str], share: float) -> dict[str, float]:
    """Metrics as the engine sums them over micro-batches and ranks: globally normalised ones
    (``additive``: the loss and its parts) as they are, means over this micro-batch's tokens scaled by
    its ``share`` of the mini-batch's tokens (:func:`token_share`). Every metric then comes out the same
    however the mini-batch was split."""
    return {key: value if key in additive else value * share for key, value in metrics.items()}


class ActorLoss:
    """``policy_loss - entropy_coeff * entropy + kl_loss_coef * KL(actor || reference)``.

    ``config`` is the ``actor.loss`` node (:class:`PolicyLossConfig`, a mapping or None);
    ``policy_loss`` a callable of kind ``policy_loss`` (default: the registry entry named by
    ``config.policy_loss["loss_mode"]``, or ``reinforce`` for bypass mode's ``loss_type: reinforce``, looked
    up in the process that builds the loss). Reads
    ``response_mask``, ``old_log_probs``, ``advantages`` and, with ``use_kl_loss``, ``ref_log_prob``
    from the micro-batch; ``log_probs`` and, with ``entropy_coeff != 0``, ``entropy`` from the engine's
    outputs (:attr:`needs_entropy` tells the worker to ask for it). Metrics add ``actor/pg_loss``,
    ``actor/entropy`` and ``actor/kl_loss`` / ``actor/kl_coef`` when used.

    With ``config.rollout_correction`` (set by the run in bypass mode) the policy term is corrected per
    micro-batch (:func:`rlplat.losses.rollout_correction.bypass_correction`, on ``rollout_log_probs``,
    which the micro-batch must carry): rejection narrows the policy loss's mask (the entropy and KL terms
    keep the sampled one; the global token and sequence counts stay those of the sampled mask, as in
    verl), and the policy loss is the configured one for ``loss_type: ppo_clip`` or the registered
    ``reinforce`` (``-A * w * log_prob``, ``w`` the detached weights) for ``loss_type: reinforce``, taken
    against ``rollout_log_probs``. The ``rollout_corr/*`` metrics come as contributions like the others,
    per-sequence ones scaled by the micro-batch's share of the sequences.

    ``config.policy_loss_coef`` weighs the policy term (0: left out) and ``config.terms`` adds more
    registered policy losses, each times its ``coef``, called with ``config.policy_loss`` set to the term's
    own knobs, ``config.inputs`` (:class:`LossInputs`) and ``config.global_counts`` (the engine's counts of
    each mask in :attr:`count_masks`); each aggregates itself and returns its metrics as contributions. The
    attributes :attr:`count_masks` and :attr:`gather_ids` tell the engine what the terms need (see
    :class:`rlplat.contracts.engine.LossFunction`).
    """

    config_schema = PolicyLossConfig

    def __init__(self, config: Any = None, policy_loss: Callable[..., Any] | None = None):
        self.config = read_config_node(config, PolicyLossConfig, "actor.loss")
        self.rollout_correction = None
        loss_mode = self.config.loss_mode
        if self.config.rollout_correction is not None:
            from rlplat.losses.rollout_correction import BYPASS_PG_LOSS, read_rollout_correction

            self.rollout_correction = read_rollout_correction(self.config.rollout_correction)
            if not self.rollout_correction.bypass_mode:
                raise ConfigError("actor.loss.rollout_correction: the actor loss corrects in bypass mode only (decoupled "
                                  "correction weights and rejects the batch before the update); this node has bypass_mode=false")
            if self.rollout_correction.loss_type == "reinforce":
                loss_mode = BYPASS_PG_LOSS
        from rlplat import registry

        if policy_loss is None:
            policy_loss = registry.get("policy_loss", loss_mode)
        self.policy_loss = policy_loss
        self.terms = [(registry.get("policy_loss", term["loss_mode"]), float(term.get("coef", 1.0)),
                       {key: value for key, value in term.items() if key != "coef"}) for term in self.config.terms]
        used = [self.policy_loss] if self.config.policy_loss_coef != 0 else []
        self.count_masks, self.gather_ids = loss_needs(used + [function for function, _, _ in self.terms])

    @property
    def needs_entropy(self) -> bool:
        """Whether the engine must compute ``entropy`` during the update (``entropy_coeff != 0``)."""
        return self.config.entropy_coeff != 0

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        settings = with_global_counts(self.config, micro_batch.meta_info)
        batch = micro_batch.batch
        response_mask, log_prob = batch["response_mask"], outputs["log_probs"]
        if self.count_masks or self.terms:
            settings = dataclasses.replace(settings, inputs=LossInputs(outputs, batch),
                                           global_counts=micro_batch.meta_info.get("global_counts") or {})
        correction_metrics: dict[str, float] = {}
        if settings.policy_loss_coef == 0:
            loss, metrics = log_prob.sum() * 0.0, {}
        elif self.rollout_correction is not None:
            loss, metrics, correction_metrics = self.bypass_policy_term(settings, batch, log_prob)
        else:
            weighted = settings
            if "rollout_is_weights" in batch.keys():  # rollout correction: each token's policy loss times its weight
                weighted = dataclasses.replace(settings, rollout_is_weights=batch["rollout_is_weights"])
            loss, metrics = self.policy_loss(
                batch["old_log_probs"], log_prob, batch["advantages"], response_mask, settings.loss_agg_mode, weighted
            )
        if settings.policy_loss_coef != 0:
            metrics = {**metrics, "actor/pg_loss": metric(loss)}
            loss = loss * settings.policy_loss_coef
        term_metrics: dict[str, float] = {}
        for function, coef, knobs in self.terms:  # each normalised over its own mask: contributions as they are
            term, reported = function(batch["old_log_probs"], log_prob, batch["advantages"], response_mask,
                                      settings.loss_agg_mode, dataclasses.replace(settings, policy_loss=knobs))
            loss = loss + coef * term
            term_metrics.update(reported)
        if settings.entropy_coeff != 0:
            entropy = aggregate_with_settings(outputs["entropy"], response_mask, settings.loss_agg_mode, settings)
            loss = loss - settings.entropy_coeff * entropy
            metrics["actor/entropy"] = metric(entropy)
        if settings.use_kl_loss:
            kl, kl_metrics = kl_loss(log_prob, batch["ref_log_prob"], response_mask, settings.loss_agg_mode, settings)
            loss = loss + settings.kl_loss_coef * kl
            metrics.update(kl_metrics)
            metrics["actor/kl_coef"] = float(settings.kl_loss_coef)
        additive = {"actor/pg_loss", "actor/entropy", "actor/kl_loss"}
        return loss, {**as_contributions(metrics, additive, metric_share(response_mask, settings.global_token_count)),
                      **correction_metrics, **term_metrics}

    def bypass_policy_term(self, settings: PolicyLossConfig, batch: Any,
                           log_prob: torch.Tensor) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """The policy loss of a bypass-mode micro-batch, its metrics, and the ``rollout_corr/*`` metrics
        as contributions (see the class docstring)."""
        from rlplat.losses.rollout_correction import bypass_correction, is_per_sequence

        correction = self.rollout_correction
        keys = batch.keys()
        if "rollout_log_probs" not in keys:
            raise ValueError("actor loss: algorithm.rollout_correction in bypass mode corrects each micro-batch against the "
                             "rollout's log-probs, and this micro-batch has no rollout_log_probs; the rollout must return them")
        if "rollout_is_weights" in keys:
            raise ValueError("actor loss: this micro-batch carries rollout_is_weights from decoupled correction, and "
                             "algorithm.rollout_correction is in bypass mode, which computes its own: use one mode")
        response_mask, rollout_log_prob = batch["response_mask"], batch["rollout_log_probs"]
        weights, policy_mask, raw = bypass_correction(log_prob, rollout_log_prob, response_mask, correction)
        weighted = settings if weights is None else dataclasses.replace(settings, rollout_is_weights=weights)
        loss, metrics = self.policy_loss(rollout_log_prob, log_prob, batch["advantages"], policy_mask,
                                         settings.loss_agg_mode, weighted)
        tokens = token_share(response_mask, settings.global_token_count)
        sequences = sequence_share(response_mask, settings.global_sequence_count)
        contributions = {key: value * (sequences if is_per_sequence(key, correction) else tokens) for key, value in raw.items()}
        return loss, metrics, contributions


class LossInputs(Mapping):
    """A micro-batch's columns and the engine's outputs by name, outputs first: what a policy loss that reads
    more than its four tensors finds in ``config.inputs``. Lazy outputs (``entropy``, ``gathered_log_probs``)
    are computed when read."""

    def __init__(self, outputs: Mapping[str, torch.Tensor], batch: Any):
        self.outputs, self.batch = outputs, batch

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.outputs:
            return self.outputs[key]
        return self.batch[key]

    def __contains__(self, key: object) -> bool:
        return key in self.outputs or key in self.batch.keys()

    def __iter__(self) -> Any:
        return iter([*self.outputs, *(key for key in self.batch.keys() if key not in self.outputs)])

    def __len__(self) -> int:
        return len(list(iter(self)))


class CriticLoss:
    """The clipped value loss of :func:`rlplat.losses.value.value_loss` for one micro-batch.

    Reads ``response_mask``, ``values`` (old predictions) and ``returns`` from the micro-batch and
    ``values`` (new predictions, with gradient) from the engine's outputs.
    """

    config_schema = ValueLossConfig
    needs_entropy = False

    def __init__(self, config: Any = None):
        self.config = read_config_node(config, ValueLossConfig, "critic.loss")

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        settings = with_global_counts(self.config, micro_batch.meta_info)
        batch = micro_batch.batch
        loss, metrics = value_loss(outputs["values"], batch["returns"], batch["values"], batch["response_mask"], None, settings)
        additive = {"critic/vf_loss"}
        return loss, as_contributions(metrics, additive, metric_share(batch["response_mask"], settings.global_token_count))


def loss_needs(functions: Any) -> tuple[tuple[str, ...], str | None]:
    """The masks whose global counts ``functions`` (policy losses) read, and the id column whose log-probs
    they gather (one at most)."""
    masks: list[str] = []
    gathers = {getattr(function, "gather_ids", None) for function in functions} - {None}
    for function in functions:
        for mask in getattr(function, "count_masks", ()) or ():
            if mask not in masks:
                masks.append(mask)
    if len(gathers) > 1:
        raise ValueError(f"the actor loss's terms gather log-probs at different id columns ({', '.join(sorted(gathers))}); "
                         "an engine gathers at one")
    return tuple(masks), next(iter(gathers), None)
