"""Sharded, resumable checkpoints and the Hugging Face export.

A checkpoint directory holds what ``torch.distributed.checkpoint`` (DCP) writes for the model and the
optimizer (each rank its own shards, re-shardable to another world size), one
``engine_state_rank<r>.pt`` per rank (LR schedule, step, and the RNG states of torch, CUDA, ``random``
and numpy; tensors and plain values only, read back with ``weights_only=True``), and
``checkpoint.json``, written last. Everything goes into ``<path>.partial`` first and is renamed to
``<path>`` once every rank has finished, so an interrupted save never looks complete. ``path`` must be
on a filesystem every rank sees.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

FORMAT_VERSION = 1
MARKER = "checkpoint.json"


def rank_state_file(directory: Path, rank: int) -> Path:
    return directory / f"engine_state_rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """The RNG states of this process in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine_state: dict[str, Any], facts: dict[str, Any]) -> None:
    """Write the checkpoint described in the module docstring; every rank calls it.

    ``engine_state`` (this rank's LR schedule and step) is stored with the RNG states; ``facts`` go
    into ``checkpoint.json`` for people and for :func:`load_checkpoint`'s checks.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    target = Path(path).absolute()
    partial = target.with_name(target.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    # Reading the state dict of an optimizer that has not stepped would create its state (a zero-lr
    # step), changing what the next real step does; such an optimizer is saved as "no state" instead.
    optimizer_started = bool(optimizer.state)
    if optimizer_started:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=str(partial))
    torch.save({**engine_state, "rng": rng_state()}, rank_state_file(partial, rank))
    dist.barrier()
    if rank == 0:
        facts = {**facts, "format_version": FORMAT_VERSION, "world_size": world_size, "optimizer_started": optimizer_started}
        (partial / MARKER).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        previous = target.with_name(target.name + ".previous")
        if target.exists():
            shutil.rmtree(previous, ignore_errors=True)
            target.rename(previous)
        partial.rename(target)
        shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model and optimizer shards and this rank's RNG states from ``path``; returns this rank's
    engine state (LR schedule, step). Raises ``FileNotFoundError`` for a missing or incomplete checkpoint."""
    target = Path(path).absolute()
    marker = target / MARKER
    if not marker.is_file():
        reason = "does not exist" if not target.exists() else f"has no {MARKER}, so its save did not finish"
        raise FileNotFoundError(f"fsdp2 checkpoint {str(target)!r} {reason}; give a directory FSDP2Engine.save wrote")
    facts = json.loads(marker.read_text())
    rank = dist.get_rank()
    if facts.get("optimizer_started"):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(target))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(target))
        set_model_state_dict(model, state["model"])
        optimizer.state.clear()
    own = rank_state_file(target, rank)
    if own.is_file():
        engine_state = torch.load(own, weights_only=True)
        set_rng_state(engine_state.pop("rng"))
    else:
        warnings.warn(
            f"checkpoint {str(target)!r} was written by {facts.get('world_size')} ranks and has no state for rank "
            f"{rank}: its RNG continues unrestored (the LR schedule and step come from rank 0)",
            stacklevel=2,
        )
        engine_state = torch.load(rank_state_file(target, 0), weights_only=True)
        engine_state.pop("rng")
    return engine_state


def export_hf(path: str, model: torch.nn.Module, hf_config: Any, model_class: Any, tokenizer_path: str | None) -> None:
    """Gather the full state dict on rank 0 and write a ``save_pretrained`` directory (and the tokenizer,
    when one is known); every rank calls it."""
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with torch.device("meta"):
            plain = model_class.from_config(hf_config, dtype=torch.float32)
        plain.load_state_dict(full_state, assign=True, strict=False)
        plain.tie_weights()
        missing = [name for name, parameter in plain.named_parameters() if parameter.is_meta]
        if missing:
            raise RuntimeError(f"export_hf: the gathered state dict has no value for {missing}")
        target = Path(path)
        target.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(str(target))
        if tokenizer_path is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(str(target))
    dist.barrier()
