"""Whole training runs from tests: :func:`fit_run`, :func:`fit_overrides`, tiny tasks for short runs
(:func:`doubling_assets`, :func:`doubling_overrides`; :func:`sums_assets`, :func:`sums_overrides`, which the
backend rollouts' run tests share), and :func:`probed` (the sync probe's figures of a run)."""

from __future__ import annotations

from pathlib import Path
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


def doubling_assets(root: Path) -> dict[str, str]:
    """A tiny random model and eight "a+a=" prompts (ground truth 2a) under ``root``: ``{"model", "train"}``."""
    from rlplat.kits.data import write_parquet
    from rlplat.testing.tiny_models import save_tiny_model

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{a}="}],
             "reward_model": {"ground_truth": str(2 * a)}} for a in range(8)]
    return {"model": save_tiny_model(Path(root) / "model", seed=0), "train": write_parquet(rows, Path(root) / "train.parquet")}


def doubling_overrides(assets: dict[str, str], run: Any, *extra: str) -> list[str]:
    """A 4-step GRPO run on :func:`doubling_assets` in this process (2 prompts x 2 samples of 3 tokens a step),
    writing to ``run``; ``extra`` overrides come last."""
    return [f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3", "actor.optim.lr=1e-2",
            "actor.micro_batch_size_per_gpu=4", "reward.scorer=exact_match", "cluster.backend=local",
            "cluster.threads_per_process=1", f"trainer.output_dir={run}", "trainer.logger=[jsonl]",
            "trainer.val_before_train=false", "trainer.total_training_steps=4", *extra]


def probed(records: list[dict]) -> list[float]:
    """The weight-sync probe's mean absolute log-prob difference per token, of every step of ``records`` that ran it."""
    return [record["sync_probe/mean_abs_diff"] for record in records if "sync_probe/mean_abs_diff" in record]


def sums_assets(root: Path) -> dict[str, str]:
    """A tiny random model and twelve "a+b=" prompts under ``root``: ``{"model", "train"}``."""
    from rlplat.kits.data import write_parquet
    from rlplat.testing.tiny_models import save_tiny_model

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"ground_truth": str(a + b)}} for a, b in [(i, 3 * i % 7) for i in range(12)]]
    return {"model": save_tiny_model(Path(root) / "model", seed=0), "train": write_parquet(rows, Path(root) / "train.parquet")}


def sums_overrides(assets: dict[str, str], run: Any, *extra: str) -> list[str]:
    """A short GRPO run on :func:`sums_assets` in this process (4 prompts x 2 samples of 3 tokens a step), writing
    metrics only (JSONL) to ``run``, no validation, no checkpoints; ``extra`` (the rollout, the steps) comes last."""
    return [f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.response_length=3", "actor.optim.lr=1e-3",
            "actor.micro_batch_size_per_gpu=8", "reward.scorer=exact_match", "cluster.backend=local", "cluster.threads_per_process=1",
            f"trainer.output_dir={run}", "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.save_freq=0", *extra]
