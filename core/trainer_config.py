"""The ``trainer`` keys ``rlplat run`` and ``rlplat sft`` share: one definition, so a key means the same in
both commands and a setting moves between them unchanged.

:class:`SharedTrainerConfig` holds the keys whose meaning is the same in both: the run's length,
checkpoints, resume, the validation before the first step and the metric loggers. Each command's
``trainer`` node subclasses it and adds its own keys, and the keys whose meaning differs between the two
(``test_freq``: an RL run does not validate with 0, an SFT run validates at its end; ``seed``: it also
orders an RL run's data; ``output_dir``: a different default). This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

__all__ = ["SharedTrainerConfig"]


@dataclasses.dataclass
class SharedTrainerConfig:
    """The ``trainer`` keys of ``rlplat run`` and ``rlplat sft``: the run's length, checkpoints and metrics."""

    total_training_steps: Optional[int] = None
    """Steps to train; None: ``total_epochs`` passes over the training data."""
    total_epochs: int = 1
    """Passes over the training data when ``total_training_steps`` is None."""
    save_freq: int = 0
    """Save a checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    keep_last: int = 3
    """Complete checkpoints kept."""
    val_before_train: bool = True
    """Validate once before the first step (when a validation set is given)."""
    resume: str = "auto"
    """``auto`` (the latest complete checkpoint in ``output_dir``, if any), ``disable``, or a checkpoint path."""
    logger: List[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    """Metric backends: ``console``, ``jsonl``, ``tensorboard``, ``wandb``."""
    project_name: str = "rlplat"
    """Project name for wandb."""
    experiment_name: Optional[str] = None
    """Run name for wandb (default: the output directory's name)."""
