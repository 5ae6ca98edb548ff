"""Config schemas this plugin adds to rlplat's own (torch-free, so the registry can point at them).

The nodes every algorithm shares are core's: the ``algorithm`` node is
:class:`rlplat.contracts.algorithm.AlgorithmConfig`, ``actor.loss`` is
:class:`rlplat.losses.PolicyLossConfig`, ``critic.loss`` is :class:`rlplat.losses.ValueLossConfig`.
Here are the knobs of this plugin's policy losses (``actor.loss.policy_loss``) and DAPO's algorithm node.
"""

from __future__ import annotations

import dataclasses

from rlplat.contracts.algorithm import AlgorithmConfig


@dataclasses.dataclass
class LossModeConfig:
    """The ``actor.loss.policy_loss`` node of this plugin's policy losses: which one, and the knobs of
    the covariance losses."""

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
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``algorithm.filter_groups``)."""

    enable: bool = True
    """Drop every group whose ``metric`` is the same for all its responses, and sample more prompts until
    the step has ``data.train_batch_size`` groups."""
    metric: str = "seq_reward"
    """``seq_reward`` (summed token-level scores), ``seq_final_reward`` (summed token-level rewards) or the
    name of a non-tensor column a scorer returns (e.g. ``acc``)."""
    max_num_gen_batches: int = 10
    """Generation rounds allowed per step before the run stops with an explanation (0: no bound)."""


@dataclasses.dataclass
class DAPOConfig(AlgorithmConfig):
    """DAPO's ``algorithm`` node: the shared keys plus dynamic sampling."""

    filter_groups: FilterGroupsConfig = dataclasses.field(default_factory=FilterGroupsConfig)
    """Dynamic sampling of informative groups."""
