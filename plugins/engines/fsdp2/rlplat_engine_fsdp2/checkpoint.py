"""Sharded, resumable checkpoints and the Hugging Face export.

A checkpoint directory holds what ``torch.distributed.checkpoint`` (DCP) writes for the model and the
optimizer (each rank its own shards, re-shardable to another world size), one
``engine_state_rank<r>.pt`` per rank (LR schedule, step, and the RNG states of torch, CUDA, ``random``
and numpy; tensors and plain values only, read back with ``weights_only=True``), and
``checkpoint.json``, written last. Everything goes into ``<path>.partial`` first and is renamed to
``<path>`` once every rank has finished, so an interrupted save never looks complete. ``path`` must be
on a filesystem every rank sees.

A LoRA engine saves ``adapter_only``: the parameters that train (the adapter) and their optimizer
state, never the frozen base weights, which the engine rebuilds from ``model_path`` (or its config and
seed) before loading. ``checkpoint.json`` records which kind a checkpoint is, and loading it into an
engine of the other kind is refused; it also records a fingerprint of the frozen weights (the sum of
their squares), and an adapter is not loaded onto other base weights.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
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


#: Relative difference of two frozen-weight fingerprints that still counts as the same base weights: the
#: sums differ only by the order of float64 additions (another world size shards them otherwise).
FINGERPRINT_TOLERANCE = 1e-9


def frozen_fingerprint(model: torch.nn.Module) -> float:
    """Sum of the squares of every frozen parameter, in float64, over every rank's shards (a collective when
    the model is sharded)."""
    total = torch.zeros((), dtype=torch.float64)
    sharded = False
    for parameter in model.parameters():
        if not parameter.requires_grad:
            sharded |= isinstance(parameter, DTensor)
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            total += local.detach().double().square().sum().cpu()
    if dist.get_world_size() > 1 and sharded:  # a replicated model's every rank holds all of it
        total = total.to(torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(total)
    return float(total)


def state_dict_options(adapter_only: bool) -> StateDictOptions:
    # Loading leaves the frozen parameters out as saving did, so the load is not strict about them.
    return StateDictOptions(ignore_frozen_params=True, strict=False) if adapter_only else StateDictOptions()


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine_state: dict[str, Any], facts: dict[str, Any],
                    adapter_only: bool = False) -> None:
    """Write the checkpoint described in the module docstring; every rank calls it.

    ``engine_state`` (this rank's LR schedule and step) is stored with the RNG states; ``facts`` go
    into ``checkpoint.json`` for people and for :func:`load_checkpoint`'s checks. ``adapter_only``:
    only the parameters that require gradients, and their optimizer state.
    """
    options = state_dict_options(adapter_only)
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
    fingerprint = frozen_fingerprint(model) if adapter_only else None
    if optimizer_started:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(model, options=options)}
    dcp.save(state, checkpoint_id=str(partial))
    torch.save({**engine_state, "rng": rng_state()}, rank_state_file(partial, rank))
    dist.barrier()
    if rank == 0:
        facts = {**facts, "format_version": FORMAT_VERSION, "world_size": world_size, "optimizer_started": optimizer_started,
                 "adapter_only": adapter_only}
        if adapter_only:
            facts["base_weights_fingerprint"] = fingerprint
        (partial / MARKER).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        previous = target.with_name(target.name + ".previous")
        if target.exists():
            shutil.rmtree(previous, ignore_errors=True)
            target.rename(previous)
        partial.rename(target)
        shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, adapter_only: bool = False) -> dict[str, Any]:
    """Restore model and optimizer shards and this rank's RNG states from ``path``; returns this rank's
    engine state (LR schedule, step). Raises ``FileNotFoundError`` for a missing or incomplete checkpoint,
    ``ValueError`` for one of the other kind (``adapter_only`` or not)."""
    target = Path(path).absolute()
    marker = target / MARKER
    if not marker.is_file():
        reason = "does not exist" if not target.exists() else f"has no {MARKER}, so its save did not finish"
        raise FileNotFoundError(f"fsdp2 checkpoint {str(target)!r} {reason}; give a directory FSDP2Engine.save wrote")
    facts = json.loads(marker.read_text())
    saved_adapter_only = bool(facts.get("adapter_only", False))
    if saved_adapter_only != adapter_only:
        kinds = {True: "a LoRA adapter and its optimizer state (actor.lora.rank > 0)", False: "full weights (no LoRA)"}
        raise ValueError(f"fsdp2 checkpoint {str(target)!r} holds {kinds[saved_adapter_only]}, but this engine trains "
                         f"{kinds[adapter_only]}; resume with the actor.lora settings the checkpoint was written with")
    if adapter_only:
        saved, here = facts.get("base_weights_fingerprint"), frozen_fingerprint(model)
        if saved is not None and abs(saved - here) > FINGERPRINT_TOLERANCE * max(abs(saved), abs(here)):
            raise ValueError(f"fsdp2 checkpoint {str(target)!r} holds a LoRA adapter trained on other base weights "
                             f"(fingerprint {saved!r}, this engine's {here!r}); build the engine from the model_path "
                             "(or model_config and seed) the checkpoint was written with")
    options = state_dict_options(adapter_only)
    rank = dist.get_rank()
    if facts.get("optimizer_started"):
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(target))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
    else:
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=str(target))
        set_model_state_dict(model, state["model"], options=options)
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
    write_hf(path, full_state, hf_config, model_class, tokenizer_path)


def write_hf(path: str, full_state: dict[str, torch.Tensor], hf_config: Any, model_class: Any, tokenizer_path: str | None) -> None:
    """Write ``full_state`` (Hugging Face names, whole tensors; read on rank 0 only) as a
    ``save_pretrained`` directory, with the tokenizer when one is known; every rank calls it."""
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


def trainable_state(parameters: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    global_step: int) -> dict[str, Any]:
    """This rank's trainable state in memory (:meth:`TrainingEngine.trainable_state`): copies of the trainable
    parameters (the adapter's, with LoRA; this rank's shards when sharded), their gradients so far, the optimizer's
    state, the LR schedule and the step count."""
    trainable = {name: parameter for name, parameter in parameters.items() if parameter.requires_grad}
    return {
        "parameters": {name: parameter.detach().clone() for name, parameter in trainable.items()},
        "gradients": {name: None if parameter.grad is None else parameter.grad.detach().clone() for name, parameter in trainable.items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "lr_scheduler": copy.deepcopy(lr_scheduler.state_dict()),
        "global_step": global_step,
    }


def load_trainable_state(state: Mapping[str, Any], parameters: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                         lr_scheduler: Any) -> int:
    """Put back what :func:`trainable_state` captured (the state is left as it was: it may be loaded again); returns
    the step count."""
    trainable = {name: parameter for name, parameter in parameters.items() if parameter.requires_grad}
    held = state.get("parameters") if isinstance(state, Mapping) else None
    if not isinstance(held, Mapping) or set(held) != set(trainable):
        raise ValueError(f"load_trainable_state: the state holds other parameters than this engine trains ({len(held or ())} "
                         f"vs {len(trainable)}): it comes from another engine or LoRA config")
    with torch.no_grad():
        for name, parameter in trainable.items():
            parameter.copy_(held[name])
            gradient = state["gradients"][name]
            parameter.grad = None if gradient is None else gradient.clone()
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    lr_scheduler.load_state_dict(copy.deepcopy(state["lr_scheduler"]))
    return int(state["global_step"])


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (its shards of AdamW's moments and the step counters)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total
