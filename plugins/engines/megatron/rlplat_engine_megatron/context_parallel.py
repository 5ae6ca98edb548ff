"""Context parallelism for the megatron engine (``context_parallel_size``): each rank of a context-parallel
group runs a share of every sequence's tokens, through megatron-core's context-parallel layout, with an
attention that runs on any backend (gloo included).

megatron-core's own context-parallel attention is Transformer Engine's (its ``DotProductAttention`` refuses
a context-parallel size above 1, and Transformer Engine has no CPU build). This module keeps the rest of
megatron's context parallelism and replaces only the attention kernel:

* **Layout** (megatron's load-balanced one): a micro-batch's left-aligned rows are padded to a multiple of
  ``2 x CP`` positions and cut into ``2 x CP`` chunks; rank ``r`` runs chunks ``r`` and ``2 CP - 1 - r``
  (:func:`local_positions`), so every rank gets the same share of the causal work. megatron's rotary
  embedding slices its positions the same way (``get_pos_emb_on_this_cp_rank``), its pipeline sends
  ``sequence / CP`` tokens, and its DDP sums gradients over the data- and context-parallel ranks.
* **Attention** (:func:`attention_class`): megatron's ``DotProductAttention`` on this rank's
  queries against the keys and values of the whole sequence, all-gathered over the group
  (:func:`gather_sequence`, whose backward sums every rank's gradient of a rank's keys and values back to
  it). The mask of the rank's query rows against every key position carries causality and padding. Each
  rank keeps the whole sequence's keys and values (key/value heads before grouped-query attention repeats
  them) per layer: the all-gather form of context parallelism, not the ring.
* **Outputs**: each rank computes the log-probs (entropy, values, gathered log-probs, top-k) of the response
  positions among its tokens only (:func:`shard_inputs` compacts them), and :func:`spread_outputs` puts
  them into ``[B, R]`` and sums over the group: every position is one rank's, so the sum is the whole
  batch's outputs, on every rank; its backward passes each rank the gradient of its own positions. Every
  rank of the group then computes the same loss, and megatron's gradient reduction over the data- and
  context-parallel ranks sums the ranks' parts of the gradient.
* **Mixture of experts**: each rank's routers see its tokens (``[local positions, rows]`` flattened), so the
  routers' valid-token mask and replayed routes are sliced like the tokens, recorded routes are gathered from
  the group back into sequence order (:func:`gather_tokens`), and the router losses are the whole rows' on
  every rank (:func:`sum_over`: expert counts, probabilities and z-loss terms summed over the group).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
import torch.distributed as dist


def local_positions(width: int, size: int, rank: int) -> torch.Tensor:
    """The positions of a ``width``-token sequence (a multiple of ``2 x size``) that context-parallel rank
    ``rank`` of ``size`` runs: chunks ``rank`` and ``2 size - 1 - rank`` of ``2 x size``."""
    chunk = width // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def padded_width(width: int, size: int) -> int:
    """``width`` rounded up to a multiple of ``2 x size``."""
    return -(-width // (2 * size)) * (2 * size)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dimension 0 over ``group``, reordered from the ranks' chunks into sequence order;
    backward sums the gradient over the group and hands each rank its own chunks' part."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(pieces, tensor, group=group)
        order = sequence_order(tensor.shape[0], size, tensor.device)
        ctx.group, ctx.size, ctx.rank, ctx.order = group, size, rank, order
        return torch.cat(pieces).index_select(0, order)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        by_rank = torch.empty_like(gradient).index_copy_(0, ctx.order, gradient)  # back to the ranks' order
        dist.all_reduce(by_rank, group=ctx.group)
        return by_rank.chunk(ctx.size)[ctx.rank].contiguous(), None


def sequence_order(local: int, size: int, device: Any = None) -> torch.Tensor:
    """Indices into the ranks' local tokens concatenated in rank order (``size`` ranks, ``local`` tokens
    each: two chunks) that give the sequence in position order."""
    chunk = local // 2
    sources = [rank * local for rank in range(size)] + [rank * local + chunk for rank in reversed(range(size))]
    return torch.cat([torch.arange(start, start + chunk) for start in sources]).to(device)


def gather_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` [local tokens, ...] of every rank of ``group`` -> [whole sequence, ...] in position order."""
    return _GatherSequence.apply(tensor, group)


def sum_over(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over ``group``; differentiable when it requires grad (:class:`_SumOver`)."""
    if tensor.requires_grad:
        return _SumOver.apply(tensor, group)
    tensor = tensor.contiguous().clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def gather_tokens(tokens: torch.Tensor, rows: int, width: int, group: Any) -> torch.Tensor:
    """This rank's per-token values in the routers' order (``[local positions x rows, ...]``) -> the whole
    micro-batch's ``[width x rows, ...]`` in sequence order, the padding to ``2 x CP`` dropped (not differentiable)."""
    local = tokens.reshape(-1, rows, *tokens.shape[1:]).contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    whole = torch.cat(pieces).index_select(0, sequence_order(local.shape[0], len(pieces), local.device))
    return whole[:width].reshape(width * rows, *tokens.shape[1:])


class _SumOver(torch.autograd.Function):
    """All-reduce sum over ``group``; the gradient passes unchanged (every rank computes the same loss from
    the sum, and each rank's summand is its own positions)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gradient, None


_ATTENTION: list[type] = []


def attention_class() -> type:
    """:class:`ContextParallelAttention`'s class, defined on first use (megatron is imported only then)."""
    if _ATTENTION:
        return _ATTENTION[0]
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ContextParallelAttention(DotProductAttention):
        """megatron's ``DotProductAttention`` on this rank's queries against the whole sequence's keys and
        values (see the module docstring); takes the mask ``[b, 1, local tokens, sequence]``."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any):
            alone = copy.copy(config)
            alone.context_parallel_size = 1  # the parent refuses CP; its kernel is the same for one rank's queries
            kwargs.pop("cp_comm_type", None)
            super().__init__(alone, *args, **kwargs)
            self.cp_group = parallel_state.get_context_parallel_group()

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
            key, value = gather_sequence(key, self.cp_group), gather_sequence(value, self.cp_group)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    _ATTENTION.append(ContextParallelAttention)
    return ContextParallelAttention


def use_in(spec: Any) -> Any:
    """The decoder layer ``spec`` (megatron's local one) with the context-parallel attention as its core attention."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = attention_class()
    return spec


def shard_inputs(inputs: Mapping[str, torch.Tensor], size: int, rank: int) -> dict[str, torch.Tensor]:
    """The engine's model inputs of a micro-batch (``tokens``, ``position_ids`` [b, T], ``attention_mask``
    [b, 1, T, T], ``predictors``, ``responses`` [b, R]) -> this rank's: its positions of the rows padded to
    a multiple of ``2 x size``, the mask of its query rows against every position, and its response
    positions compacted to ``predictors`` / ``responses`` [b, K] with ``cp_slots`` (each one's response
    index, ``R`` where a row has fewer than K) and ``cp_response_length`` for :func:`spread_outputs`."""
    tokens, mask = inputs["tokens"], inputs["attention_mask"]
    rows, width = tokens.shape
    wide = padded_width(width, size)
    if wide > width:
        pad = wide - width
        tokens = torch.nn.functional.pad(tokens, (0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad, 0, pad), value=True)
    positions = local_positions(wide, size, rank).to(tokens.device)
    local_of = torch.full((wide,), -1, dtype=torch.long, device=tokens.device)
    local_of[positions] = torch.arange(len(positions), device=tokens.device)
    predictors, responses = inputs["predictors"], inputs["responses"]
    response_length = predictors.shape[1]
    here = local_of[predictors] >= 0
    count = max(int(here.sum(-1).max()), 1)
    slots = torch.sort((~here).int(), dim=1, stable=True).indices[:, :count]  # this rank's response indices first
    kept = here.gather(1, slots)
    local = local_of[predictors.gather(1, slots)].clamp(min=0)
    sharded = dict(inputs)
    if "valid" in inputs:  # a MoE model's routers: tokens in [sequence, rows] order (rlplat_engine_megatron.moe)
        valid = inputs["valid"].view(width, rows)
        sharded["cp_tokens"] = (width, rows, int(valid.sum()))
        sharded["valid"] = torch.cat([valid, valid.new_zeros((wide - width, rows))])[positions].reshape(-1)
        if "routes" in inputs:
            routes = inputs["routes"].view(width, rows, *inputs["routes"].shape[1:])
            routes = torch.cat([routes, routes.new_full((wide - width, *routes.shape[1:]), -1)])[positions]
            sharded["routes"] = routes.reshape(-1, *routes.shape[2:])
    sharded.update(
        tokens=tokens[:, positions], position_ids=positions.unsqueeze(0).expand(rows, -1).contiguous(),
        attention_mask=mask[:, :, positions, :].contiguous(), predictors=local, responses=responses.gather(1, slots),
        cp_slots=torch.where(kept, slots, torch.full_like(slots, response_length)), cp_response_length=response_length,
    )
    return sharded


def compact(values: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``values`` [b, R, ...] of every response position -> [b, K, ...] at this rank's (``cp_slots``)."""
    slots = inputs["cp_slots"].clamp(max=values.shape[1] - 1)
    values = values.to(slots.device)
    return values.gather(1, slots.view(*slots.shape, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:]))


def spread_outputs(outputs: Mapping[str, torch.Tensor], inputs: Mapping[str, Any], group: Any) -> dict[str, torch.Tensor]:
    """This rank's outputs [b, K, ...] -> the group's [b, R, ...], on every rank (see the module docstring)."""
    slots, response_length = inputs["cp_slots"], inputs["cp_response_length"]
    spread = {}
    for key, value in outputs.items():
        rows, count = slots.shape
        index = slots.view(rows, count, *([1] * (value.dim() - 2))).expand(-1, -1, *value.shape[2:])
        whole = value.new_zeros(rows, response_length + 1, *value.shape[2:]).scatter(1, index, value)[:, :response_length]
        if whole.requires_grad:
            spread[key] = _SumOver.apply(whole, group)
        else:
            whole = whole.contiguous()
            dist.all_reduce(whole, group=group)
            spread[key] = whole
    return spread
