"""The data helpers plugins share: left-padding token lists the way the data loader feeds a model, the pad
token of a tokenizer, checking a data file, writing prompt rows to parquet, and :class:`DataError`, the one
error for data that does not fit (the run's data loader, rlplat-sft's, a judge's or a reward model's inputs,
the demo's builders). Importing it imports neither torch nor pyarrow (the config reader uses :class:`DataError`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlplat.config_node import ConfigError

if TYPE_CHECKING:
    import torch


class DataError(ConfigError):
    """The data files or their rows do not fit the schema or the ``data.*`` config; the message says
    which file, row and column, and what to do."""


def check_file(path: str, config_key: str) -> None:
    """A :class:`DataError` in the words of ``config_key`` if ``path`` is not an existing file."""
    if not os.path.exists(path):
        raise DataError(f"{config_key}: {path} does not exist")
    if os.path.isdir(path):
        raise DataError(f"{config_key}: {path} is a directory; list the parquet files in it instead")


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad token id, else its EOS id (the usual stand-in); :class:`DataError` if neither."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise DataError("the tokenizer has neither a pad token nor an EOS token to left-pad prompts with; set tokenizer.pad_token")


def left_padded(token_lists: Sequence[Sequence[int]], pad_token_id: int) -> "dict[str, torch.Tensor]":
    """``input_ids``, ``attention_mask`` and ``position_ids`` (int64, ``[B, W]``) of ``token_lists`` left-padded
    to the longest: ``pad_token_id`` on the left, 1 on real tokens, positions
    ``clamp(cumsum(attention_mask) - 1, 0)`` (0 on the padding and the first real token). What the data
    loader, the judge and the reward model feed a model."""
    import torch

    width = max(len(tokens) for tokens in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for number, tokens in enumerate(token_lists):
        input_ids[number, width - len(tokens):] = torch.as_tensor(tokens, dtype=torch.long)
        attention_mask[number, width - len(tokens):] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str:
    """Write ``rows`` (dicts in the schema of the module docstring) to a parquet file at ``path``,
    creating its folder; returns the path. The column types are inferred from the values (a struct's
    fields are the union over the rows; a row without one of them reads back with it null). Nothing
    is validated here: :class:`RLDataset` does that when it reads the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        table = pa.Table.from_pylist([dict(row) for row in rows])
    except (pa.ArrowException, TypeError) as error:
        raise DataError(f"cannot write {path}: the rows do not share column types ({error})") from error
    pq.write_table(table, path)
    return path
