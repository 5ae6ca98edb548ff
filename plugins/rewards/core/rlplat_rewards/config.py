"""The reward managers' own settings: the ``reward.config`` node (torch-free, so the registry can point at it).

Which scorer a run uses (``reward.scorer`` or ``reward.custom_function``) is core's part of the ``reward``
node (:class:`rlplat.config.RewardConfig`); the driver resolves it and hands the scorer to the manager.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlplat.config_node import ConfigError

ISOLATION_MODES = ("auto", "thread", "process")
"""The values of ``reward.config.isolation`` (see :mod:`rlplat_rewards.isolation`)."""


def check_isolation(isolation: object, processes: object) -> None:
    """Raise a :class:`~rlplat.config_node.ConfigError` naming the key when ``isolation`` is not one of
    :data:`ISOLATION_MODES` or ``processes`` is not an integer >= 1."""
    if isolation not in ISOLATION_MODES:
        raise ConfigError(f"reward.config.isolation: expected {'|'.join(ISOLATION_MODES)}, got {isolation!r}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"reward.config.processes: expected an integer >= 1 (scorer processes), got {processes!r}")


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
    """Per-sample time limit of the ``naive`` and ``dapo`` managers, of the whole call for ``batch``
    (None: no limit). What overruns it gets ``fallback_score`` and counts in ``reward/timeouts``; with
    ``isolation`` at ``process`` its scorer process is killed (``reward/killed``, a health event)."""
    isolation: str = "auto"
    """Where the scorer runs: ``auto``, ``thread`` or ``process``. ``process``: in scorer processes of
    their own (``processes``), one killed and replaced when a sample overruns ``timeout_s``, so a scorer
    stuck in C code holding the GIL (a regular expression backtracking catastrophically) costs that
    sample, not the run. ``thread``: in this process with the timeout on a thread, which cannot stop a
    scorer looping in C. ``auto``: ``process`` when ``timeout_s`` is set and the scorer is not known safe
    (a registered scorer whose registration says ``safe``: ``exact_match``, ``gsm8k``, ``gsm8k_flexible``,
    ``math``), else ``thread``; without ``timeout_s`` there is no deadline to kill at. A scorer that
    cannot be rebuilt in another process (a lambda, a closure) stays on a thread under ``auto``, with a
    warning, and is an error under ``process``."""
    processes: int = 1
    """Scorer processes when ``isolation`` gives them (each imports the scorer once: about 30 MB, 70 MB
    with ``math_verify``'s sympy). One matches these managers, which score one sample at a time."""
    max_resp_len: Optional[int] = None
    """DAPO: the response length the overlong buffer counts from (None: the batch's response width)."""
    overlong_buffer: OverlongBufferConfig = dataclasses.field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping."""

    def __post_init__(self) -> None:
        check_isolation(self.isolation, self.processes)
