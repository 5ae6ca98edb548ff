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
import os
import shutil
from pathlib import Path
from typing import Any, List, Optional

from rlplat.config_node import ConfigError

__all__ = ["SharedTrainerConfig", "RUN_CONFIG_FILE", "check_run_directory", "first_logged_step", "prepare_run_directory"]

#: What ``trainer.logger`` may list (:class:`rlplat.trainer.tracking.Tracker` writes each).
LOGGER_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")

RUN_CONFIG_FILE = "config.yaml"
"""What every run writes first into its directory (the resolved config): how a run directory is recognised."""


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
    overwrite: bool = False
    """With ``resume=disable``: clear ``output_dir`` (an earlier run's directory) before the run. Without it a
    fresh run into a directory that holds anything is refused, so that two runs' metrics and checkpoints
    never mix."""
    logger: List[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    """Metric backends: ``console``, ``jsonl``, ``tensorboard``, ``wandb``."""
    project_name: str = "rlplat"
    """Project name for wandb."""
    experiment_name: Optional[str] = None
    """Run name for wandb (default: the output directory's name)."""


def check_run_directory(trainer: Any) -> None:
    """A fresh run (``trainer.resume=disable``) starts in an empty ``output_dir``, or clears an earlier
    run's with ``trainer.overwrite=true``; raises :class:`ConfigError` otherwise. Reads the directory only."""
    directory = Path(trainer.output_dir)
    if trainer.overwrite and trainer.resume != "disable":
        raise ConfigError(f"trainer.overwrite=true clears {directory} before a fresh run, but trainer.resume="
                          f"{trainer.resume} resumes from it: add trainer.resume=disable to start afresh, or drop "
                          "trainer.overwrite to resume.")
    if trainer.resume != "disable" or not directory.exists():
        return
    if not directory.is_dir():
        raise ConfigError(f"trainer.output_dir: {directory} exists and is not a directory.")
    entries = sorted(entry.name for entry in directory.iterdir())
    if not entries:
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    if not trainer.overwrite:
        raise ConfigError(f"trainer.resume=disable starts a fresh run, but trainer.output_dir {directory} already holds "
                          f"{shown}: add trainer.overwrite=true to clear it first, choose another trainer.output_dir, "
                          "or resume it with trainer.resume=auto.")
    if RUN_CONFIG_FILE not in entries:
        raise ConfigError(f"trainer.overwrite=true clears only a run's directory, and {directory} holds {shown} "
                          f"but no {RUN_CONFIG_FILE} of a run: choose another trainer.output_dir or empty it yourself.")


def prepare_run_directory(trainer: Any) -> Path:
    """``output_dir``, created, after :func:`check_run_directory`; cleared first when ``trainer.overwrite``
    allows it (each entry removed; links are removed, never followed)."""
    check_run_directory(trainer)
    directory = Path(trainer.output_dir)
    if trainer.overwrite and directory.is_dir():
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                os.unlink(entry)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def first_logged_step(step: int) -> int:
    """The first step a run that starts after ``step`` logs: 0 for a fresh run (its validation before
    training is step 0), else ``step + 1``. The metrics an earlier run left at or past it are dropped, so a
    run without a checkpoint to resume keeps none of them."""
    return step + 1 if step else 0
