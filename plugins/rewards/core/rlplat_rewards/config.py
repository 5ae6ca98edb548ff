"""The reward managers' own settings: the ``reward.config`` node (torch-free, so the registry can point at it).

Which scorer a run uses (``reward.scorer`` or ``reward.custom_function``) is core's part of the ``reward``
node (:class:`rlplat.config.RewardConfig`); the driver resolves it and hands the scorer to the manager.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (``reward.config.overlong_buffer``)."""

    enable: bool = False
    """Add ``min(-(length - expected_len) / len * penalty_factor, 0)`` to the score."""
    len: int = 4096
    """Buffer length: the penalty ramps from 0 at ``max_resp_len - len`` tokens to ``-penalty_factor`` at ``max_resp_len``."""
    penalty_factor: float = 1.0
    """The penalty at the full response length."""
    log: bool = False
    """Add the ``overlong_reward`` and ``overlong`` columns to the output (and their metrics)."""


@dataclasses.dataclass
class RewardManagerConfig:
    """The ``reward.config`` node of this plugin's managers."""

    fallback_score: float = 0.0
    """Score given to a sample whose scorer raised or timed out (counted in ``reward/errors``)."""
    raise_on_error: bool = False
    """Raise instead of falling back when the scorer fails on a sample."""
    timeout_s: Optional[float] = None
    """Per-sample time limit of the ``naive`` and ``dapo`` managers (None: no limit)."""
    max_resp_len: Optional[int] = None
    """DAPO: the response length the overlong buffer counts from (None: the batch's response width)."""
    overlong_buffer: OverlongBufferConfig = dataclasses.field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping."""
