"""Rollout dump and replay: each step's generated batch as parquet, and a run that trains on those files instead
of generating.

``trainer.rollout_dump_dir=DIR`` writes ``DIR/step_<N>.parquet`` (N zero-padded to 6 digits) after step N's
batch is generated and scored, before anything trains on it: one row per sample, a column per tensor (token ids,
masks, the rollout's log-probs, ``policy_version``, ``token_level_scores``, ...; each row's values as a list of
the tensor's dtype, so every value reads back bit for bit) and per non-tensor column (``uid``, ``data_source``,
``reward_model``, agent trajectories, ...: JSON text where a value survives JSON unchanged, else pickled bytes).
The file's metadata holds each column's dtype, shape and encoding and the batch's ``meta_info`` (JSON). A file is
written whole or not at all (a temporary name, then a rename).

``trainer.replay_rollouts=DIR`` trains on the files of such a directory: step N's batch is ``DIR/step_<N>.parquet``,
generation and scoring are skipped (validation and the weight-sync probe still generate). With the same config
and seed the updates are those of the run that wrote the files, bit for bit on CPU (the old log-probs, advantages
and updates depend only on the batch and the weights). Only ``trainer.mode=sync`` replays.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlplat.contracts.observer import ObservedRun, StepObserver
from rlplat.protocol import DataProto

METADATA_KEY = b"rlplat.rollout_dump"


class ReplayError(RuntimeError):
    """A replay directory that cannot give the run its batches."""


def step_file(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.parquet"


def _json_exact(values: Any) -> bool:
    try:
        return json.loads(json.dumps(list(values))) == list(values)
    except (TypeError, ValueError):
        return False


def write_batch(batch: DataProto, path: Path) -> None:
    """``batch`` as the parquet file ``path`` (see the module docstring)."""
    columns: dict[str, pa.Array] = {}
    layout: dict[str, Any] = {}
    for key in batch.batch.keys():
        tensor = batch.batch[key].detach().cpu().contiguous()
        values = tensor.reshape(len(batch), -1)
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, as int16
            values = values.view(torch.int16)
        columns[key] = pa.array(list(values.numpy()))
        layout[key] = {"kind": "tensor", "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape[1:])}
    for key, values in batch.non_tensor_batch.items():
        values = list(values)
        if _json_exact(values):
            columns[key] = pa.array([json.dumps(value) for value in values], pa.string())
            layout[key] = {"kind": "json"}
        else:
            columns[key] = pa.array([pickle.dumps(value) for value in values], pa.binary())
            layout[key] = {"kind": "pickle"}
    meta = json.dumps({"layout": layout, "meta_info": batch.meta_info, "rows": len(batch)}, default=str)
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: meta.encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    pq.write_table(table, partial)
    os.replace(partial, path)


def read_batch(path: Path) -> DataProto:
    """The batch :func:`write_batch` wrote to ``path``."""
    if not path.is_file():
        raise ReplayError(f"no rollout dump at {path}")
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ReplayError(f"{path} is not a rollout dump (no {METADATA_KEY.decode()} metadata)")
    meta = json.loads(raw)
    tensors, non_tensors = {}, {}
    for key, spec in meta["layout"].items():
        column = table.column(key).to_pylist()
        if spec["kind"] == "tensor":
            dtype = getattr(torch, spec["dtype"])
            storage = torch.int16 if dtype == torch.bfloat16 else dtype
            values = torch.from_numpy(np.asarray(column, dtype=torch.empty(0, dtype=storage).numpy().dtype))
            values = values.view(dtype) if dtype == torch.bfloat16 else values
            tensors[key] = values.reshape(meta["rows"], *spec["shape"])
        elif spec["kind"] == "json":
            non_tensors[key] = [json.loads(value) for value in column]
        else:
            non_tensors[key] = [pickle.loads(value) for value in column]
    return DataProto.from_dict(tensors, non_tensors, meta_info=meta["meta_info"])


def check_replay(directory: str | os.PathLike[str], first_step: int, last_step: int) -> None:
    """Every step from ``first_step`` to ``last_step`` has its file in ``directory``; else :class:`ReplayError`
    naming the missing steps (before anything starts)."""
    if not Path(directory).is_dir():
        raise ReplayError(f"trainer.replay_rollouts: {directory} is not a directory")
    missing = [step for step in range(first_step, last_step + 1) if not step_file(directory, step).is_file()]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ReplayError(f"trainer.replay_rollouts: {directory} has no batch for steps {shown} (of {first_step}..{last_step}); "
                          "it holds what a run with trainer.rollout_dump_dir wrote, one step_<N>.parquet per step")


class DumpObserver(StepObserver):
    """``trainer.rollout_dump_dir`` as a step observer (kind ``step_observer``, registered by rlplat): each step's
    generated and scored batch, as it came (health events included), before anything reads it."""

    order = 0

    def __init__(self, run: ObservedRun, directory: str):
        self.run, self.directory = run, directory

    def on_stage(self, name: str, batch: Any, metrics: dict[str, Any]) -> None:
        if name == "generated":
            write_batch(batch, step_file(self.directory, self.run.step))


def observer(run: ObservedRun) -> DumpObserver | None:
    directory = run.config.trainer.rollout_dump_dir
    return DumpObserver(run, directory) if directory is not None else None

