"""The built-in demo: a tiny arithmetic model and its task data, shipped inside the package.

The assets under ``assets/`` are produced by ``python -m rlplat.demo.build`` (see :mod:`rlplat.demo.build`):

* ``assets/model/``: a 0.53M-parameter Qwen2 causal LM and its 16-token arithmetic tokenizer, warm-started
  by supervised steps until greedy validation accuracy passes a threshold, so that RL has signal;
* ``assets/data/train.parquet`` and ``assets/data/val.parquet``: ``a+b=`` prompts with two 2-digit operands,
  in the schema of :mod:`rlplat.data` (``data_source="arith"``), the validation pairs disjoint from training;
* ``assets/build_info.json``: how they were built (seed, steps, validation accuracy, sizes).

:mod:`rlplat.demo.scorer` holds the demo's reward, an exact match of the answer. Importing this package
imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

BUILD_COMMAND = "python -m rlplat.demo.build"


class DemoAssetsMissing(FileNotFoundError):
    """The demo's shipped assets are not where the installed package expects them."""


def assets_dir() -> Path:
    """The folder of the demo's assets inside the installed package."""
    return _existing(Path(__file__).resolve().parent / "assets", "the demo assets folder")


def model_dir() -> Path:
    """The demo model's ``save_pretrained`` folder (model and tokenizer), for ``from_pretrained``."""
    return _existing(assets_dir() / "model" / "config.json", "the demo model").parent


def train_file() -> Path:
    """The demo's training prompts (parquet)."""
    return _existing(assets_dir() / "data" / "train.parquet", "the demo training data")


def val_file() -> Path:
    """The demo's validation prompts (parquet), disjoint from the training prompts."""
    return _existing(assets_dir() / "data" / "val.parquet", "the demo validation data")


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise DemoAssetsMissing(
            f"{what} is missing: {path} does not exist. The demo assets ship with rlplat; in a source checkout "
            f"regenerate them with `{BUILD_COMMAND}`, or reinstall rlplat"
        )
    return path
