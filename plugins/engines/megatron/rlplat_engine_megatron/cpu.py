"""Running megatron-core on a CPU build of torch: the substitutes for its CUDA-only calls, confined to a
``with`` block.

megatron-core 0.16.1 with its local (non-Transformer-Engine) layer spec computes correctly on CPU
tensors, but a handful of call sites ask CUDA for something on the way (measured in MEGATRON_NOTES.md):
the RNG tracker keeps CUDA generator states and is forked in every attention forward; buffers are
allocated on ``torch.cuda.current_device()``; schedules, the optimizers and gradient clipping pass
``device="cuda"``; the distributed optimizer checks ``Tensor.type()`` for a ``torch.cuda.*`` name;
tied embeddings call ``.cuda()``; pipeline p2p calls ``torch.cuda.synchronize()``; activation
recompute saves and restores the CUDA RNG state; the rotary embedding's context-parallel slice indexes through
pinned memory.

:func:`cpu_substitutes` answers each of them for CPU while the block runs and restores every patched
name when it ends, so code outside the block (other engines, the rollout, the test process) sees the
real ``torch.cuda``. The engine enters it around every call into megatron. With a GPU nothing is
substituted (:func:`megatron_context` gives a plain context).

:class:`CpuRNGStatesTracker` is megatron's RNG tracker with CPU generator states: the same named
states (data-parallel, tensor-parallel, expert-parallel seeds with megatron's offsets), forked around
the same regions, drawn from the CPU generator. The engine owns one and installs it for the block.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

#: megatron's offsets of the named RNG states (``model_parallel_cuda_manual_seed``).
TENSOR_PARALLEL_OFFSET = 2718
EXPERT_PARALLEL_OFFSET = 1024


def is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaDevicesToCpu(TorchFunctionMode):
    """Inside: a ``device`` argument naming CUDA means the CPU, ``Tensor.cuda()`` is the tensor itself,
    and ``Tensor.type()`` answers with the CUDA type name of a CPU tensor (megatron's optimizers accept
    only those names)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if is_cuda_device(argument) else argument for argument in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """megatron's ``CudaRNGStatesTracker`` interface over CPU generator states: ``add(name, seed)``
    records a state, ``fork(name)`` runs its block with the CPU generator set to that state and keeps
    where it got to, then puts the caller's state back."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked (tracked: {sorted(self.states_)})")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    def seed(self, seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
        """megatron's ``model_parallel_cuda_manual_seed`` for CPU states: the same names and offsets."""
        from megatron.core.tensor_parallel import random

        self.reset()
        self.add(random.get_data_parallel_rng_tracker_name(), seed)
        self.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + TENSOR_PARALLEL_OFFSET + tp_rank)
        self.add(random.get_expert_parallel_rng_tracker_name(), seed + EXPERT_PARALLEL_OFFSET + 100 * ep_rank + etp_rank)


MISSING = object()


class Patches:
    """Attribute replacements (or additions) undone in reverse order."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name, MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self.saved:
            owner, name, value = self.saved.pop()
            if value is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def no_op(*args: Any, **kwargs: Any) -> None:
    return None


def positions_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron's ``get_pos_emb_on_this_cp_rank`` (the rotary embedding of this context-parallel rank's two
    chunks of ``2 x CP``) with its index on the embedding's device instead of pinned memory copied to CUDA."""
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:]).index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


@contextlib.contextmanager
def cpu_substitutes(tracker: CpuRNGStatesTracker) -> Iterator[None]:
    """megatron-core on CPU for the duration of the block (see the module docstring)."""
    from megatron.core.tensor_parallel import random

    patches = Patches()
    patches.set(torch.cuda, "current_device", lambda: "cpu")
    patches.set(torch.cuda, "synchronize", no_op)
    patches.set(torch.cuda, "empty_cache", no_op)
    patches.set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    patches.set(torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
    patches.set(random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    patches.set(random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
    patches.set(random, "_CUDA_RNG_STATE_TRACKER", tracker)
    patches.set(random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.transformer.moe import moe_utils

    patches.set(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", positions_on_this_cp_rank)

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 binds it only when Transformer Engine imports, and the router's gating GEMM reads
        # it unguarded (moe_utils.py:1192): a MoE layer without TE raises NameError; None takes its torch path
        patches.set(moe_utils, "te_general_gemm", None)
    try:
        with CudaDevicesToCpu():
            yield
    finally:
        patches.undo()


def megatron_context(tracker: CpuRNGStatesTracker, on_cpu: bool) -> "contextlib.AbstractContextManager[None]":
    """:func:`cpu_substitutes` on CPU; on GPU megatron runs as it is (a plain context)."""
    return cpu_substitutes(tracker) if on_cpu else contextlib.nullcontext()
