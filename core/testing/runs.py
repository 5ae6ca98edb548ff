"""Whole training runs from tests: :func:`fit_run`, :func:`fit_overrides`."""

from __future__ import annotations

from typing import Any, Callable


def fit_run(config: Any, *, trainer_class: type | None = None, inspect: Callable[[Any], None] | None = None) -> list[dict]:
    """Train ``config`` to the end with :class:`rlplat.trainer.Trainer` (or a subclass, ``trainer_class``),
    call ``inspect(trainer)`` while its workers still run, stop them in every case, and return the run's
    metric records (:func:`rlplat.trainer.tracking.read_metrics`)."""
    from rlplat.trainer.tracking import read_metrics
    from rlplat.trainer import Trainer

    trainer = (trainer_class or Trainer)(config)
    try:
        trainer.fit()
        if inspect is not None:
            inspect(trainer)
    finally:
        trainer.shutdown()
    return read_metrics(config.trainer.output_dir)


def fit_overrides(overrides: list[str], algo: str = "grpo") -> None:
    """Train the run the dotted ``overrides`` describe to its end (resuming from its latest checkpoint, as
    ``trainer.resume`` says): the body of a child process a test kills and starts again."""
    from rlplat.config import load_config

    fit_run(load_config(overrides=overrides, algo=algo))
