"""Typed configs of the reward managers (the ``reward`` node), and the function that reads them.

Every manager accepts its config as :class:`RewardManagerConfig`, a plain ``Mapping``, an OmegaConf
``DictConfig`` or ``None`` (defaults). Keys the dataclass does not know are ignored: the node passed in
is the whole ``reward`` node, which also names the scorer and the custom function. This module imports
no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Optional


@dataclasses.dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (``reward.overlong_buffer``)."""

    enable: bool = False
    """Add ``min(-(length - expected_len) / len * penalty_factor, 0)`` to the score."""
    len: int = 4096
    """Buffer length: the penalty ramps from 0 at ``max_resp_len - len`` tokens to ``-penalty_factor`` at ``max_resp_len``."""
    penalty_factor: float = 1.0
    """The penalty at the full response length."""
    log: bool = False
    """Add the ``overlong_reward`` and ``overlong`` columns to the output (and their metrics)."""


@dataclasses.dataclass
class CustomFunctionConfig:
    """A user's scoring function (``reward.custom_function``)."""

    path: Optional[str] = None
    """Python file that defines it; when set it replaces ``reward.scorer``."""
    name: str = "compute_score"
    """Name of the function in that file (sync or ``async def``)."""


@dataclasses.dataclass
class RewardManagerConfig:
    """The ``reward`` node as far as the reward managers and scorer lookup read it."""

    scorer: str = "gsm8k"
    """Registered reward scorer (kind ``reward_scorer``), used unless ``custom_function.path`` is set."""
    manager: str = "naive"
    """Registered reward manager (kind ``reward_manager``)."""
    custom_function: CustomFunctionConfig = dataclasses.field(default_factory=CustomFunctionConfig)
    """A user's scoring function loaded from a file."""
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


def read_config(config: Any, schema: type = RewardManagerConfig, *, where: str = "reward") -> Any:
    """``config`` (a ``schema`` instance, a Mapping, an OmegaConf DictConfig or None) -> a ``schema`` instance."""
    if config is None:
        return schema()
    if isinstance(config, schema):
        config = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    if not isinstance(config, Mapping):
        raise TypeError(f"{where} must be a {schema.__name__}, a mapping or None, got {type(config).__name__}")
    hints = typing.get_type_hints(schema)
    values = {}
    for field in dataclasses.fields(schema):
        if field.name in config:
            value = config[field.name]
            nested = hints[field.name]
            if isinstance(nested, type) and dataclasses.is_dataclass(nested):
                value = value if isinstance(value, nested) else read_config(value, nested, where=f"{where}.{field.name}")
            values[field.name] = value
    return schema(**values)
