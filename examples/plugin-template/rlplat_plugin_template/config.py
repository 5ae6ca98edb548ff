"""The config schema of this plugin's policy loss. Torch-free: rlplat loads it to check a run's config
before any worker starts (a misspelled or mistyped key under ``actor.loss.policy_loss`` is an error)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TruncatedISConfig:
    """The ``actor.loss.policy_loss`` node when ``loss_mode`` is ``example_truncated_is``."""

    loss_mode: str = "example_truncated_is"
    """The registered policy loss (kind ``policy_loss``)."""
    ratio_cap: float = 2.0
    """Importance weights ``exp(log_prob - old_log_prob)`` above this are truncated to it (must be > 0)."""

    def __post_init__(self) -> None:
        if self.ratio_cap <= 0:
            raise ValueError(f"ratio_cap must be > 0, got {self.ratio_cap}")
