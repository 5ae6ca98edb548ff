"""The knobs of the distillation losses, as one entry of ``actor.loss.terms`` (or ``actor.loss.policy_loss``)
holds them (torch-free: the config loader checks them). The losses are :mod:`rlplat_distill.losses`."""

from __future__ import annotations

import dataclasses
from typing import Optional

#: The per-token estimators of the sampled-token reverse KL (rlplat_distill.losses reads them from here: torch-free)
SAMPLED_ESTIMATORS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


@dataclasses.dataclass
class SampledTermConfig:
    """``reverse_kl``: the reverse KL on the sampled tokens."""

    loss_mode: str = "reverse_kl"
    """Registered policy loss (kind ``policy_loss``)."""
    estimator: str = "k3"
    """Per-token estimate of ``KL(student || teacher)``: k1 (``s - t``), k2, k3 (``exp(t - s) - (t - s) - 1``), abs."""
    use_policy_gradient: bool = True
    """Train on the estimate's policy gradient (advantage ``-estimate``, PPO-clipped against ``old_log_probs``):
    the gradient of the reverse KL. False differentiates the estimate itself (not with k1)."""
    loss_max_clamp: Optional[float] = None
    """Clamp each token's estimate to ``[-c, c]`` (None: no clamp)."""

    def __post_init__(self) -> None:
        if self.estimator not in SAMPLED_ESTIMATORS:
            raise ValueError(f"estimator must be one of {', '.join(SAMPLED_ESTIMATORS)}, got {self.estimator!r}")
        if not self.use_policy_gradient and self.estimator in ("k1", "kl"):
            raise ValueError("use_policy_gradient=false with estimator k1: its gradient does not depend on the teacher; "
                             "use the policy gradient or k3/k2")
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            raise ValueError(f"loss_max_clamp must be > 0 or null, got {self.loss_max_clamp}")


@dataclasses.dataclass
class TopKTermConfig:
    """``reverse_kl_topk``, ``forward_kl_topk``, ``jsd_topk``: a divergence over the teacher's top-k ids."""

    loss_mode: str = "reverse_kl_topk"
    """Registered policy loss (kind ``policy_loss``)."""
    beta: float = 0.5
    """``jsd_topk``: the mixture weight of the teacher (0: forward KL, 1: reverse KL; 0.5 the symmetric JSD)."""
    renormalize: bool = True
    """Renormalise both distributions over the k ids before comparing them (with k = vocabulary nothing changes)."""
    loss_max_clamp: Optional[float] = None
    """Clamp each position's divergence to ``[-c, c]`` (None: no clamp)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            raise ValueError(f"loss_max_clamp must be > 0 or null, got {self.loss_max_clamp}")
