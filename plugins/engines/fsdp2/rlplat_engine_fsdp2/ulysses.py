"""Ulysses sequence parallelism (``ulysses_sequence_parallel_size``): the ranks of one sequence-parallel group
share a micro-batch's pack, each holding a contiguous slice of its tokens.

Every layer but attention is per token, so each rank runs it on its slice. Around attention, one all-to-all
trades the slice of every head for every token of a share of the heads (``[1, H, N/sp, D]`` ->
``[1, H/sp, N, D]``), attention runs within each sequence of the whole pack as it would on one rank, and a
second all-to-all trades back (``[1, N, H/sp, D]`` -> ``[1, N/sp, H, D]``). Both are autograd functions
whose backward is the reverse all-to-all, so backward (and an activation-checkpointing recompute) runs
the same collectives in the same order on every rank of the group. Key and value heads are repeated where
their count does not divide by ``sp`` (the least repeat that does: grouped-query attention keeps its
grouping).

The pack is padded at its end to a multiple of ``sp`` tokens (one extra sequence of its own, whose outputs
are dropped); position ids travel with the tokens. Each rank computes the outputs (log-probs, entropy,
values) of the response positions in its slice, and :meth:`PackShard.gather` collects them from the group in
pack order, so every rank of the group sees the micro-batch's whole ``[B, R]`` outputs and computes the
same loss. The gather's backward passes each rank the gradient of its own slice's outputs: summed over the
group's ranks (FSDP2's gradient reduction does the sum) that is the gradient of one loss.

Groups are ``sp`` consecutive ranks (``rank // sp`` is the data-parallel rank); FSDP2 shards parameters over
every rank as without sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from rlplat_engine_fsdp2 import packing


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` consecutive ranks, this one at ``rank`` within it."""

    group: Any
    size: int
    rank: int

    def __repr__(self) -> str:  # model kwargs are sometimes printed; the process group is not worth it
        return f"SequenceParallel(size={self.size}, rank={self.rank})"


def new_groups(size: int) -> SequenceParallel:
    """This rank's group of ``size`` consecutive ranks. A collective (every rank builds every group, as
    ``torch.distributed.new_group`` requires); the world size must be a multiple of ``size``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the {world} ranks")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceParallel(mine, size, rank % size)


def check_heads(hf_config: Any, size: int) -> None:
    """Raises unless the model's attention heads split over ``size`` ranks: the query heads must divide by it,
    and the key/value heads must divide it or be divided by it (then repeated)."""
    config = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"ulysses_sequence_parallel_size={size}: the model config has no num_attention_heads to split")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the model's {heads} attention heads; "
                         f"use a size that divides {heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"ulysses_sequence_parallel_size={size}: the model's {kv_heads} key/value heads neither divide "
                         f"by it nor divide it; use a size that divides {math.gcd(heads, kv_heads)} or is a multiple of {kv_heads}")


class _AllToAll(torch.autograd.Function):
    """``tensor`` ``[sp, ...]``: block ``s`` goes to rank ``s`` of the group, block ``s`` of the result came from
    rank ``s``. Its backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        dist.all_to_all_single(received, tensor, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received, None


def heads_to_sequence(tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[1, H, n, D]`` (every head of this rank's ``n`` tokens) -> ``[1, H/sp, sp*n, D]`` (this rank's share of
    the heads, every token of the pack in order)."""
    _, heads, tokens, width = tensor.shape
    blocks = tensor[0].unflatten(0, (sp.size, heads // sp.size))  # block s: the heads rank s attends
    received = _AllToAll.apply(blocks, sp.group)  # block s: rank s's tokens
    return received.permute(1, 0, 2, 3).reshape(heads // sp.size, sp.size * tokens, width).unsqueeze(0)


def sequence_to_heads(tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[1, N, H/sp, D]`` (attention output of this rank's heads over the pack) -> ``[1, N/sp, H, D]`` (every head
    of this rank's tokens): :func:`heads_to_sequence`'s inverse, in Hugging Face's output layout."""
    _, tokens, heads, width = tensor.shape
    blocks = tensor[0].unflatten(0, (sp.size, tokens // sp.size))  # block s: rank s's tokens
    received = _AllToAll.apply(blocks, sp.group)  # block s: the heads rank s attended
    return received.permute(1, 0, 2, 3).reshape(tokens // sp.size, sp.size * heads, width).unsqueeze(0)


def split_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                sp: SequenceParallel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A local attention call's query, key and value (``[1, heads, n, D]``) as this rank's heads over the whole
    pack; key and value heads repeated by the least factor that makes them divide by ``sp``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp.size:
        repeat = sp.size // math.gcd(kv_heads, sp.size)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if heads % sp.size:
        raise ValueError(f"Ulysses sequence parallelism: {heads} attention heads do not split over {sp.size} ranks")
    return heads_to_sequence(query, sp), heads_to_sequence(key, sp), heads_to_sequence(value, sp)


class _Gather(torch.autograd.Function):
    """Per-position values of each rank's slice (``counts[s]`` rows on rank ``s``) -> all of them in rank order on
    every rank; backward: the gradient of this rank's own rows."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, sp: SequenceParallel, counts: tuple[int, ...]) -> torch.Tensor:
        ctx.offset, ctx.count = sum(counts[: sp.rank]), counts[sp.rank]
        widest = max(counts)
        padded = values.new_zeros((widest, *values.shape[1:]))
        padded[: values.shape[0]] = values
        pieces = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(pieces, padded.contiguous(), group=sp.group)
        return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.offset : ctx.offset + ctx.count], None, None


@dataclasses.dataclass
class PackShard:
    """This rank's slice of a pack (from ``start``, ``length / sp`` of the pack padded to ``length`` tokens): the
    model kwargs of the call, and how its per-position outputs are gathered."""

    sp: SequenceParallel
    length: int
    start: int
    kwargs: dict[str, Any]

    def local(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """``positions`` of the pack (ascending) -> (which of them lie in this slice (a mask), their indices within
        the slice, how many lie in each rank's slice)."""
        step = self.length // self.sp.size
        owner = torch.div(positions, step, rounding_mode="floor")
        counts = tuple(int(count) for count in torch.bincount(owner.cpu(), minlength=self.sp.size).tolist())
        mine = owner == self.sp.rank
        return mine, positions[mine] - self.start, counts

    def gather(self, values: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """``[counts[rank], ...]`` values of this slice -> ``[sum(counts), ...]`` of the whole pack, on every rank
        of the group (differentiable: see :class:`_Gather`). No position anywhere (every rank reads the same
        counts): the empty values as they are, no collective."""
        if not any(counts):
            return values
        return _Gather.apply(values, self.sp, counts)


def padded_length(tokens: int, size: int) -> int:
    """The length a pack of ``tokens`` tokens is padded to for ``size`` sequence-parallel ranks (at least one
    token a rank)."""
    return max(size, -(-tokens // size) * size)


class _SumOver(torch.autograd.Function):
    """All-reduce sum over the group; the gradient passes unchanged (every rank of the group computes the same
    loss from the sum, and each rank's summand comes from its own tokens)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=sp.group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over(tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``tensor`` summed over the group's ranks, differentiable (see :class:`_SumOver`)."""
    if tensor.requires_grad:
        return _SumOver.apply(tensor, sp)
    tensor = tensor.contiguous().clone()
    dist.all_reduce(tensor, group=sp.group)
    return tensor


def gather_slices(tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Each rank's ``[length / sp, ...]`` slice of a padded pack -> the whole ``[length, ...]`` (not differentiable)."""
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(sp.size)]
    dist.all_gather(pieces, tensor, group=sp.group)
    return torch.cat(pieces)


def shard(packed: packing.Pack, sp: SequenceParallel, *, grouped_attention: bool) -> PackShard:
    """This rank's :class:`PackShard` of ``packed``: its tokens padded to a multiple of ``sp.size`` (the padding
    one sequence of its own), a contiguous ``1/sp`` of them, and the model kwargs of the whole padded pack
    (``grouped_attention``: with the attention groups of the padded pack, planned here; ``packed`` needs none)."""
    tokens = packed.input_ids.shape[1]
    length = padded_length(tokens, sp.size)
    extra = length - tokens
    input_ids, position_ids = packed.input_ids, packed.position_ids
    cu_seq_lens, max_length = packed.cu_seq_lens, packed.max_length
    if extra:
        input_ids = torch.cat([input_ids, input_ids.new_zeros((1, extra))], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(extra, device=position_ids.device, dtype=position_ids.dtype)[None]], dim=1)
        cu_seq_lens = torch.cat([cu_seq_lens, cu_seq_lens.new_tensor([length])])
        max_length = max(max_length, extra)
    lengths = [length for length in cu_seq_lens.diff().tolist() if length > 0]
    groups = packing.plan_attention_groups(lengths, input_ids.device) if grouped_attention and lengths else None
    step = length // sp.size
    start, stop = sp.rank * step, (sp.rank + 1) * step
    kwargs = dict(
        input_ids=input_ids[:, start:stop],
        position_ids=position_ids[:, start:stop],
        attention_mask=None,
        use_cache=False,
        cu_seq_lens_q=cu_seq_lens,
        cu_seq_lens_k=cu_seq_lens,
        max_length_q=max_length,
        max_length_k=max_length,
        sequence_parallel=sp,
    )
    if groups is not None:
        kwargs["packed_attention_groups"] = groups
    return PackShard(sp, length, start, kwargs)
