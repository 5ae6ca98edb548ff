"""The megatron engine's resumable checkpoints: megatron's distributed checkpoint (``dist_checkpointing``,
torch_dist format) of the model chunks and the optimizer, one ``engine_rank<r>.pt`` per rank beside it (the
engine's step and RNG states) and :data:`CHECKPOINT_MARKER`, written last by rank 0 (the engine, world size,
step and config), so an interrupted save is not taken for a checkpoint.

:class:`Checkpoints` is a base class of :class:`~rlplat_engine_megatron.engine.MegatronEngine`; it reads and sets
the engine's model chunks, optimizer, RNG states (``tracker``) and ``global_step``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist

CHECKPOINT_MARKER = "rlplat_megatron_checkpoint.json"


class Checkpoints:
    """``save`` and ``load`` of the contract."""

    def sharded_state(self) -> dict[str, Any]:
        return {"model" if len(self.chunks) == 1 else f"model{index}": chunk.module.sharded_state_dict() for index, chunk in enumerate(self.chunks)}

    def save(self, path: str) -> None:
        """megatron's distributed checkpoint (``dist_checkpointing``, torch_dist format) of the model and
        optimizer in ``path``, and the engine's step and RNG states beside it."""
        from megatron.core import dist_checkpointing

        self.require_model("save")
        if self.global_step == 0:
            raise RuntimeError(
                f"MegatronEngine.save({path!r}) before the first optimizer step: megatron's optimizer creates its state "
                "in that step, so there is nothing resumable to write yet (export_hf writes the weights)"
            )
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        with self.megatron():
            state = self.sharded_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(state if len(self.chunks) > 1 else state["model"])
            dist_checkpointing.save(state, path)
        rng = {"global_step": self.global_step, "tracker": self.tracker.get_states(), "cpu_rng": torch.get_rng_state()}
        torch.save(rng, os.path.join(path, f"engine_rank{self.rank}.pt"))
        dist.barrier()
        if self.rank == 0:
            with open(os.path.join(path, CHECKPOINT_MARKER), "w") as handle:
                json.dump({"engine": "megatron", "world_size": self.world_size, "global_step": self.global_step,
                           "config": dataclasses.asdict(self.config)}, handle, default=str)
        dist.barrier()

    def load(self, path: str) -> None:
        from megatron.core import dist_checkpointing

        self.require_model("load")
        if not os.path.isfile(os.path.join(path, CHECKPOINT_MARKER)):
            raise FileNotFoundError(f"{path} is not a complete megatron engine checkpoint (no {CHECKPOINT_MARKER} there)")
        with self.megatron():
            state = self.sharded_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(state if len(self.chunks) > 1 else state["model"], is_loading=True)
            loaded = dist_checkpointing.load(state, path)
            for index, chunk in enumerate(self.chunks):
                key = "model" if len(self.chunks) == 1 else f"model{index}"
                chunk.module.load_state_dict(loaded[key], strict=False)
            self.optimizer.load_state_dict(loaded["optimizer"])
        engine_file = os.path.join(path, f"engine_rank{self.rank}.pt")
        if os.path.isfile(engine_file):
            rng = torch.load(engine_file, weights_only=True)
            self.tracker.set_states(rng["tracker"])
            torch.set_rng_state(rng["cpu_rng"])
            self.global_step = int(rng["global_step"])
        else:
            with open(os.path.join(path, CHECKPOINT_MARKER)) as handle:
                marker = json.load(handle)
            raise ValueError(f"{path} was written by {marker.get('world_size')} ranks; this engine has {self.world_size} (rank {self.rank} finds no state)")
        self.set_lr(self.schedule(self.global_step) * self.config.lr)
