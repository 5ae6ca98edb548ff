"""The loss nodes of the run config: ``actor.loss`` (:class:`PolicyLossConfig`) and ``critic.loss``
(:class:`ValueLossConfig`), verl's key names. Torch-free, so the config loader can check them cheaply.

``global_token_count`` and ``global_sequence_count`` are not user settings: the loss function copies
them from each micro-batch's ``meta_info`` (where the engine puts the mini-batch's totals over every
data-parallel rank) before it calls a policy loss, which reads them as attributes of its ``config``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from rlplat.config_node import ConfigError

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ENGINE_SET_KEYS = ("global_token_count", "global_sequence_count")
LOSS_SET_KEYS = (*ENGINE_SET_KEYS, "rollout_is_weights", "rollout_correction", "inputs", "global_counts")
"""Keys of the loss nodes that the loss function (per micro-batch) or the run sets; a user may not set them."""


@dataclasses.dataclass
class PolicyLossConfig:
    """The ``actor.loss`` node: what the policy loss, the KL loss and the entropy bonus read."""

    clip_ratio: float = 0.2
    """PPO clip range, used for either side not given below."""
    clip_ratio_low: Optional[float] = None
    """Lower clip range: the ratio is clipped at ``1 - clip_ratio_low`` (None: ``clip_ratio``)."""
    clip_ratio_high: Optional[float] = None
    """Upper clip range: the ratio is clipped at ``1 + clip_ratio_high`` (None: ``clip_ratio``); DAPO raises it."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound: for negative advantages the loss is at most ``-A * clip_ratio_c`` (must be > 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm
    (:mod:`rlplat.losses.aggregation`)."""
    loss_scale_factor: Optional[float] = None
    """Divisor of seq-mean-token-sum-norm (None: the response width R); set it when micro-batches differ in width."""
    entropy_coeff: float = 0.0
    """Entropy bonus: ``entropy_coeff * aggregated entropy`` is subtracted from the loss. The engine computes
    entropy during the update only when this is not 0."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(actor || reference)`` to the loss (GRPO's choice, instead of KL in the reward);
    the run then builds a reference model."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: k1/kl, k2/mse, k3/low_var_kl, abs, or a straight-through ``+`` variant."""
    policy_loss: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"loss_mode": "vanilla"})
    """``loss_mode`` (the registered policy loss, kind ``policy_loss``) and that loss's own knobs, checked
    against the config schema its registry entry declares."""
    policy_loss_coef: float = 1.0
    """Weight of ``policy_loss`` in the actor loss; 0 leaves it out (pure distillation: only ``terms`` train)."""
    terms: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    """More policy losses added to the actor loss, each ``{loss_mode: <registered policy_loss>, coef: <weight>,
    ...that loss's own knobs}`` (the distillation losses of rlplat-distill: ``reverse_kl``, ``forward_kl_topk``,
    ...). Each term aggregates itself, over its own mask and that mask's global counts."""
    global_token_count: Optional[int] = None
    """Set per micro-batch by the loss function (not a user setting): valid tokens of the whole mini-batch
    over every data-parallel rank."""
    global_sequence_count: Optional[int] = None
    """Set per micro-batch by the loss function (not a user setting): rows of the whole mini-batch with a
    valid token, over every data-parallel rank."""
    rollout_is_weights: Optional[Any] = None
    """Set per micro-batch by the actor loss (not a user setting): the rollout-correction importance weights
    ``[b, R]`` (``algorithm.rollout_correction``); :func:`rlplat.losses.aggregate_with_settings` multiplies
    each token's policy loss by its weight before aggregating."""
    inputs: Optional[Any] = None
    """Set per micro-batch by the actor loss (not a user setting): the micro-batch's columns and the engine's
    outputs by name (:class:`rlplat.losses.functions.LossInputs`), for losses that read more than the four
    tensors they are called with (the distillation terms read the teacher's columns)."""
    global_counts: Optional[Dict[str, Any]] = None
    """Set per micro-batch by the actor loss (not a user setting): for each mask a loss declares in
    ``count_masks``, ``{"tokens": ..., "sequences": ...}`` of the whole mini-batch over every rank."""
    rollout_correction: Optional[Dict[str, Any]] = None
    """Set by the run (not a user setting, which is ``algorithm.rollout_correction``): that node when it is in
    bypass mode, where the actor loss computes the weights and the rejection of each micro-batch itself
    (:func:`rlplat.losses.rollout_correction.bypass_correction`) and ``loss_type`` picks its policy loss."""

    def __post_init__(self) -> None:
        check_loss_agg_mode(self.loss_agg_mode, "loss_agg_mode")
        check_terms(self.terms, self.policy_loss_coef)
        if "loss_mode" not in self.policy_loss:
            self.policy_loss = {**self.policy_loss, "loss_mode": "vanilla"}

    @property
    def loss_mode(self) -> str:
        """The registered policy loss this node selects."""
        return str(self.policy_loss["loss_mode"])


@dataclasses.dataclass
class ValueLossConfig:
    """The ``critic.loss`` node: what the clipped value loss reads."""

    cliprange_value: float = 0.5
    """New value predictions are clipped to ``old value ± cliprange_value``."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss."""
    loss_scale_factor: Optional[float] = None
    """Divisor of seq-mean-token-sum-norm (None: the response width R)."""
    global_token_count: Optional[int] = None
    """Set per micro-batch by the loss function (not a user setting); see :class:`PolicyLossConfig`."""
    global_sequence_count: Optional[int] = None
    """Set per micro-batch by the loss function (not a user setting); see :class:`PolicyLossConfig`."""

    def __post_init__(self) -> None:
        check_loss_agg_mode(self.loss_agg_mode, "loss_agg_mode")


def check_terms(terms: Any, policy_loss_coef: float) -> None:
    """``actor.loss.terms`` and ``policy_loss_coef``: each term a mapping naming its ``loss_mode`` with a
    finite ``coef``; something to train."""
    import math

    if not math.isfinite(policy_loss_coef) or policy_loss_coef < 0:
        raise ConfigError(f"actor.loss.policy_loss_coef must be a finite number >= 0, got {policy_loss_coef}")
    for index, term in enumerate(terms):
        where = f"actor.loss.terms[{index}]"
        if not isinstance(term, dict) or not term.get("loss_mode"):
            raise ConfigError(f"{where}: each term is a mapping with a loss_mode (a registered policy_loss) and a coef, got {term!r}")
        coef = term.get("coef", 1.0)
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
            raise ConfigError(f"{where}.coef must be a finite number, got {coef!r}")
    if policy_loss_coef == 0 and not terms:
        raise ConfigError("actor.loss.policy_loss_coef is 0 and actor.loss.terms is empty: the actor loss would train nothing")


def check_loss_agg_mode(mode: str, where: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"{where}: unknown loss_agg_mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


def declared_loss_agg_modes(entry: Any, declared_api: str | None) -> tuple[str, ...] | None:
    """The aggregation modes a registered policy loss says it supports: its registration's
    ``metadata={"loss_agg_modes": [...]}``, else those of the oldest plugin API version its plugin's
    declared range ``declared_api`` admits (:func:`rlplat.api_version.loss_agg_modes_of`); None when it
    declares neither (then nothing is known, and a mode it lacks is its own ``ValueError`` at run time)."""
    listed = entry.metadata.get("loss_agg_modes")
    if listed is not None:
        return tuple(listed)
    if declared_api is None:
        return None
    from rlplat.api_version import loss_agg_modes_of

    return loss_agg_modes_of(declared_api)
