"""``Worker``: the base class of everything that runs in a worker process."""

from __future__ import annotations

import os

ENV_ROLE = "RLPLAT_ROLE"


class Worker:
    """Knows its ``rank``, ``world_size``, ``local_rank`` and ``device``; by the time ``__init__`` of a
    subclass runs, ``torch.distributed`` is set up for the group (gloo on CPU, NCCL on GPU).

    Methods marked with :func:`rlplat.controller.decorator.register` become callable on the worker
    group from the driver. The same class runs under the Ray backend and the in-process one.

    During a data-parallel call, ``padding_rows`` says how many trailing rows of this worker's DataProto
    input are padding (copies of real rows added so every rank gets as many rows); a method that trains
    on its input must give them no weight (see :func:`without_padding_weight`). It is 0 otherwise.
    """

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.role = os.environ.get(ENV_ROLE, "worker")
        self._dispatch_info = (self.rank, self.world_size, True)
        self.padding_rows = 0

    @property
    def device(self) -> str:
        """``"cuda:<local device>"`` when this process sees a GPU, else ``"cpu"``."""
        import torch

        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    def set_dispatch_info(self, dp_rank: int, dp_size: int, collect: bool) -> None:
        """Declare this worker's place for ``Dispatch.DP_MESH``: its data-parallel rank, the number of
        data-parallel ranks, and whether the driver collects its output (one worker per DP group)."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not within 0..{dp_size - 1}")
        self._dispatch_info = (dp_rank, dp_size, bool(collect))

    def dispatch_info(self) -> tuple[int, int, bool]:
        return self._dispatch_info



def without_padding_weight(batch, padding_rows: int):
    """``batch`` with ``response_mask`` zeroed on its last ``padding_rows`` rows, so that padding added
    by dispatch keeps every rank's shapes equal but adds nothing to a loss or its token counts."""
    if not padding_rows:
        return batch
    from rlplat.protocol import DataProto

    mask = batch.batch["response_mask"].clone()
    mask[len(batch) - padding_rows :] = 0
    tensors = batch.batch.clone(recurse=False)
    tensors.set("response_mask", mask)
    return DataProto(tensors, batch.non_tensor_batch, batch.meta_info)
