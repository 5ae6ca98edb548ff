"""Typed configs of the algorithm plugin, with verl's key names, and the one function that reads them.

Every estimator, loss and controller accepts its config as the dataclass below, a plain ``Mapping``,
an OmegaConf ``DictConfig`` or ``None`` (the defaults) and turns it into the dataclass with
:func:`read_config`. Keys the dataclass does not know are ignored, because the node passed in is the
whole ``algorithm`` or ``actor`` node of the run config, which holds keys for other components; the
config loader is what rejects misspelled keys.

This module imports no torch, so the registry can point at these classes as config schemas cheaply.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Optional, TypeVar

ConfigT = TypeVar("ConfigT")


@dataclasses.dataclass
class KLControlConfig:
    """How the coefficient of a KL penalty in the reward evolves (``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """``fixed`` keeps ``kl_coef``; ``adaptive`` steers it toward ``target_kl`` (Ziegler et al., 2019)."""
    kl_coef: float = 0.001
    """Initial (for ``fixed``: constant) coefficient of the KL penalty."""
    horizon: int = 10000
    """Adaptive controller: samples over which a proportional error of 20% changes the coefficient by 20%."""
    target_kl: float = 0.1
    """Adaptive controller: the KL per token it aims for."""


@dataclasses.dataclass
class AlgorithmConfig:
    """The ``algorithm`` node: what advantage estimators and the KL-in-reward step read."""

    adv_estimator: str = "gae"
    """Registered advantage estimator (kind ``advantage_estimator``)."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda (bias/variance trade-off of the advantage)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO and Pass@k divide the centred score by the group's std; False is Dr. GRPO's choice."""
    epsilon: float = 1e-6
    """Added to a group's std before dividing (GRPO, Pass@k)."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL(actor || reference)`` from the token-level scores before estimating."""
    kl_penalty: str = "kl"
    """KL estimator used in the reward: k1/kl, k2/mse, k3/low_var_kl, abs, or a straight-through ``+`` variant."""
    kl_ctrl: KLControlConfig = dataclasses.field(default_factory=KLControlConfig)
    """Controller of the KL-in-reward coefficient."""


@dataclasses.dataclass
class LossModeConfig:
    """The ``actor.policy_loss`` node: which policy loss, and the knobs of the covariance losses."""

    loss_mode: str = "vanilla"
    """Registered policy loss (kind ``policy_loss``)."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: fraction of valid tokens whose gradient is detached."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: tokens whose covariance lies in (lb, ub) are candidates."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of the candidate covariance band."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: fraction of valid tokens, those of largest covariance, that get the KL term."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of ``|log_prob - old_log_prob|`` on the selected tokens."""


@dataclasses.dataclass
class PolicyLossConfig:
    """The ``actor`` node as far as the policy loss, KL loss and entropy bonus read it."""

    clip_ratio: float = 0.2
    """PPO clip range, used for either side not given below."""
    clip_ratio_low: Optional[float] = None
    """Lower clip range: the ratio is clipped at ``1 - clip_ratio_low`` (None: ``clip_ratio``)."""
    clip_ratio_high: Optional[float] = None
    """Upper clip range: the ratio is clipped at ``1 + clip_ratio_high`` (None: ``clip_ratio``); DAPO raises it."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound: for negative advantages the loss is at most ``-A * clip_ratio_c`` (must be > 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    loss_scale_factor: Optional[float] = None
    """Divisor of seq-mean-token-sum-norm (None: the response width R); set it when micro-batches differ in width."""
    entropy_coeff: float = 0.0
    """Entropy bonus: ``entropy_coeff * aggregated entropy`` is subtracted from the loss."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(actor || reference)`` to the loss (GRPO's choice, instead of KL in the reward)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss (see ``AlgorithmConfig.kl_penalty``)."""
    policy_loss: LossModeConfig = dataclasses.field(default_factory=LossModeConfig)
    """Which policy loss and its own knobs."""
    global_token_count: Optional[int] = None
    """Valid tokens of the whole mini-batch over all ranks; set per micro-batch by the loss function."""
    global_sequence_count: Optional[int] = None
    """Sequences of the whole mini-batch over all ranks; set per micro-batch by the loss function."""


@dataclasses.dataclass
class ValueLossConfig:
    """The ``critic`` node as far as the clipped value loss reads it."""

    cliprange_value: float = 0.5
    """New value predictions are clipped to ``old value ± cliprange_value``."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss."""
    loss_scale_factor: Optional[float] = None
    """Divisor of seq-mean-token-sum-norm (None: the response width R)."""
    global_token_count: Optional[int] = None
    """Valid tokens of the whole mini-batch over all ranks; set per micro-batch by the loss function."""
    global_sequence_count: Optional[int] = None
    """Sequences of the whole mini-batch over all ranks; set per micro-batch by the loss function."""


def read_config(config: Any, schema: type[ConfigT], *, where: str = "config") -> ConfigT:
    """``config`` (a ``schema`` instance, a Mapping, an OmegaConf DictConfig or None) -> a ``schema`` instance.

    Unknown keys are ignored (see the module docstring); nested dataclass fields are read
    recursively. A value of the wrong kind for a nested node raises a ``TypeError`` naming ``where``.
    """
    if config is None:
        return schema()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        if isinstance(config, schema) and _nested_fields_are_typed(config):
            return config
        config = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    if not isinstance(config, Mapping):
        raise TypeError(
            f"{where} must be a {schema.__name__}, a mapping or None, got {type(config).__name__}: {config!r:.80}"
        )
    hints = typing.get_type_hints(schema)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(schema):
        if field.name not in config:
            continue
        value = config[field.name]
        nested = hints[field.name]
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            value = read_config(value, nested, where=f"{where}.{field.name}")
        values[field.name] = value
    return schema(**values)


def _nested_fields_are_typed(config: Any) -> bool:
    hints = typing.get_type_hints(type(config))
    return all(
        isinstance(getattr(config, field.name), hints[field.name])
        for field in dataclasses.fields(config)
        if isinstance(hints[field.name], type) and dataclasses.is_dataclass(hints[field.name])
    )


def with_global_counts(config: Any, schema: type[ConfigT], meta_info: Mapping[str, Any]) -> ConfigT:
    """The config with ``global_token_count`` / ``global_sequence_count`` taken from a micro-batch's
    ``meta_info`` (keys of the same names, as :class:`rlplat.contracts.engine.LossFunction` describes)."""
    parsed = read_config(config, schema)
    return dataclasses.replace(
        parsed,
        global_token_count=meta_info.get("global_token_count", getattr(parsed, "global_token_count")),
        global_sequence_count=meta_info.get("global_sequence_count", getattr(parsed, "global_sequence_count")),
    )
