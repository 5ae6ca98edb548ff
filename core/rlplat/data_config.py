"""The ``data`` node of the run config (:class:`DataConfig`) and :class:`DataError`, without torch.

The config schema (:mod:`rlplat.config`) reads the ``data`` node with these, so a config error or a plan
that does not fit is reported without importing torch; :mod:`rlplat.data` (the dataset, the loaders and
batches, which need torch) re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

from rlplat.config_node import read_config_node
from rlplat.kits.data import DataError

__all__ = ["TRUNCATIONS", "DataConfig", "DataError", "as_file_list", "read_data_config"]

TRUNCATIONS = ("error", "filter", "left", "right")


@dataclasses.dataclass
class DataConfig:
    """The ``data`` node of the config: where the prompts are and how they become batches.
    Key names are verl's ``data.*`` where verl has them."""

    train_files: List[str] = dataclasses.field(default_factory=list)
    """Parquet files of the training prompts (a single path is also accepted), read in this order and
    concatenated; see :mod:`rlplat.data` for the columns."""
    val_files: List[str] = dataclasses.field(default_factory=list)
    """Parquet files of the validation prompts; empty: no validation set."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages, or a string when ``apply_chat_template`` is false)."""
    max_prompt_length: int = 512
    """Most tokens a prompt may have after templating; longer ones are handled by ``truncation``."""
    truncation: str = "error"
    """What to do with a prompt longer than ``max_prompt_length``: ``error`` (stop at load, naming the
    file and row), ``filter`` (drop the row at load, logged with a count), ``left`` (keep the last
    ``max_prompt_length`` tokens), ``right`` (keep the first ``max_prompt_length`` tokens)."""
    train_batch_size: int = 1024
    """Prompts per training step (before ``rollout.n`` samples each)."""
    val_batch_size: Optional[int] = None
    """Prompts per validation batch; None: the whole validation set as one batch."""
    shuffle: bool = True
    """Visit the training prompts in a fresh seeded order each epoch (False: file order every epoch)."""
    seed: int = 0
    """Seed of the shuffle: epoch ``e`` uses ``numpy.random.default_rng((seed, e))``."""
    drop_last: bool = True
    """Skip an epoch's last batch when it has fewer than ``train_batch_size`` prompts (its prompts come
    back, in another order, in the next epoch); False yields the short batch."""
    apply_chat_template: bool = True
    """Render the messages with the tokenizer's chat template (``add_generation_prompt=True``). False:
    the prompt column may hold plain strings, tokenized as they are (message lists are concatenated)."""
    apply_chat_template_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments for ``tokenizer.apply_chat_template`` (``{"enable_thinking": False}``)."""

    def __post_init__(self) -> None:
        self.train_files = as_file_list(self.train_files)
        self.val_files = as_file_list(self.val_files)
        self.apply_chat_template_kwargs = dict(self.apply_chat_template_kwargs or {})
        problems = []
        if self.truncation not in TRUNCATIONS:
            problems.append(f"data.truncation={self.truncation!r} is not one of {list(TRUNCATIONS)}")
        for name in ("max_prompt_length", "train_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.val_batch_size is not None and self.val_batch_size < 1:
            problems.append(f"data.val_batch_size must be >= 1 or null (the whole set), got {self.val_batch_size}")
        if problems:
            raise DataError("invalid data config: " + "; ".join(problems))


def as_file_list(files: Any) -> list[str]:
    """``files`` (None, one path, or a sequence of paths) as a list of strings."""
    if files is None:
        return []
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    return [os.fspath(path) for path in files]


def read_data_config(config: Any) -> DataConfig:
    """``config`` (a :class:`DataConfig`, a Mapping or an OmegaConf DictConfig) -> the dataclass, read
    with core's one config reader (an unknown key names the closest known one). From Python, one path
    is accepted where a list of files is expected."""
    if isinstance(config, Mapping):
        config = {key: [value] if key in ("train_files", "val_files") and isinstance(value, (str, os.PathLike)) else value
                  for key, value in config.items()}
    return read_config_node(config, DataConfig, "data")
