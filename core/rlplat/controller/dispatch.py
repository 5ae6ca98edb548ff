"""Dispatch modes: how a driver call's arguments are split over workers and their outputs merged.

A mode is an object with ``name`` and ``plan(layout, args, kwargs) -> CallPlan``. The plan says which
ranks to call with which arguments, and how to merge what they return. Built-in modes are registered
under kind ``dispatch_mode`` by rlplat itself; a plugin adds one with ``register_dispatch_modes``.

Padding: data-parallel modes pad a DataProto with :meth:`DataProto.pad_to_divisor` (the one padding
mechanism) so that every rank computes on the same number of rows, and tell each rank how many of its
rows are padding. Each rank reports how many rows of its output are padding; whoever materialises a
result (the driver in ``DataFuture.get``, or a worker fetching a :class:`Shard`) drops them, so results
never contain padding rows, and chained calls still get equal shards without a trip through the driver.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from rlplat.controller.decorator import Dispatch, Execute
from rlplat.protocol import DataProto


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a mode needs to know about a worker group: its size and each rank's data-parallel place."""

    world_size: int
    dp_rank: tuple[int, ...]
    dp_size: int
    collect: tuple[bool, ...]

    @classmethod
    def flat(cls, world_size: int) -> "Layout":
        return cls(world_size, tuple(range(world_size)), world_size, (True,) * world_size)


@dataclasses.dataclass
class Shard:
    """Data a worker fetches itself from the object store: the outputs of an earlier call (``sources``,
    object references or values) with their padding counts (``pads``). ``part=(index, count)`` asks
    for part ``index`` of ``count`` after joining the sources; ``None`` takes the single source as is."""

    sources: list[Any]
    pads: list[Any]
    part: tuple[int, int] | None = None


@dataclasses.dataclass
class RankCall:
    """One worker call: its rank, its arguments and how many trailing rows of its DataProto input are
    padding (``None`` when the call is not data-parallel, ``-1`` when the worker learns it from a
    :class:`Shard`)."""

    rank: int
    args: tuple
    kwargs: dict
    pad_rows: int | None = None


@dataclasses.dataclass
class CallPlan:
    calls: list[RankCall]
    merge: Callable[[list[Any]], Any]
    #: Positions (in ``calls``) of the outputs that form the data-parallel shards of the result, in
    #: order; None when the outputs are not DataProto shards.
    shard_positions: list[int] | None = None


class DataFuture:
    """The result of a non-blocking worker-group call.

    ``get()`` waits and merges, on the driver. Passing the future itself into another worker-group
    call does not: each worker fetches the part it needs straight from the object store.
    """

    def __init__(self, backend: Any, plan: CallPlan, results: list[Any], pads: list[Any], label: str):
        self.backend = backend
        self.plan = plan
        self.results = results
        self.pads = pads
        self.label = label

    def get(self) -> Any:
        values = self.backend.wait(self.results, self.plan.calls, self.label)
        pads = self.backend.wait(self.pads, self.plan.calls, self.label) if self.pads else []
        trimmed = [trim(value, pad) for value, pad in zip(values, pads)] if pads else values
        return self.plan.merge(trimmed)

    def done(self) -> bool:
        """Whether every rank's call has finished (successfully or not), without waiting."""
        ready = getattr(self.backend, "ready", None)
        return True if ready is None else ready(self.results + self.pads)

    def shards(self, count: int) -> list[Shard]:
        """How ``count`` workers each fetch their part of this future's value."""
        positions = self.plan.shard_positions
        if positions is None:
            raise TypeError(f"{self.label} does not return DataProto shards; it cannot feed a data-parallel call")
        results = [self.results[p] for p in positions]
        pads = [self.pads[p] for p in positions]
        if len(positions) == count:
            return [Shard([result], [pad]) for result, pad in zip(results, pads)]
        return [Shard(results, pads, (index, count)) for index in range(count)]

    def whole(self) -> "Shard | WholeValue":
        """How one worker fetches this future's whole value."""
        if self.plan.shard_positions is None:
            return WholeValue(list(self.results), self.plan.merge)
        return self.shards(1)[0]


@dataclasses.dataclass
class WholeValue:
    """The outputs of an earlier non-data-parallel call, fetched and merged by the worker itself."""

    results: list[Any]
    merge: Callable[[list[Any]], Any]


def trim(value: Any, pad: int | None) -> Any:
    return value.unpad(pad) if pad and isinstance(value, DataProto) else value


def padding_in_parts(length: int, padded_length: int, count: int) -> list[int]:
    """How many of each part's rows are padding after ``pad_to_divisor(count)`` and ``chunk(count)``."""
    size = padded_length // count
    return [max(0, (index + 1) * size - max(length, index * size)) for index in range(count)]


def split_data_parallel(args: tuple, kwargs: dict, count: int) -> tuple[list[tuple], list[dict], list[int]]:
    """Split every DataProto (or DataFuture) argument into ``count`` equal padded parts; broadcast the
    rest. Returns per-part args, kwargs and padding rows (-1: the worker learns it from a Shard)."""
    pads: list[int] | None = None
    lengths: set[int] = set()

    def split(value: Any) -> list[Any]:
        nonlocal pads
        if isinstance(value, DataProto):
            lengths.add(len(value))
            padded, _ = value.pad_to_divisor(count)
            if pads is None:
                pads = padding_in_parts(len(value), len(padded), count)
            return padded.chunk(count)
        if isinstance(value, DataFuture):
            if pads is None:
                pads = [-1] * count
            return value.shards(count)
        return [value] * count

    split_args = [split(value) for value in args]
    split_kwargs = {key: split(value) for key, value in kwargs.items()}
    if len(lengths) > 1:
        raise ValueError(f"data-parallel call got DataProto arguments of different lengths {sorted(lengths)}")
    per_args = [tuple(column[i] for column in split_args) for i in range(count)]
    per_kwargs = [{key: column[i] for key, column in split_kwargs.items()} for i in range(count)]
    return per_args, per_kwargs, pads if pads is not None else [0] * count


def concat_outputs(outputs: list[Any]) -> Any:
    if outputs and all(isinstance(output, DataProto) for output in outputs):
        return DataProto.concat(outputs)
    return outputs


def broadcast_value(value: Any) -> Any:
    return value.whole() if isinstance(value, DataFuture) else value


class OneToAll:
    name = Dispatch.ONE_TO_ALL.value

    def plan(self, layout: Layout, args: tuple, kwargs: dict, execute: Execute = Execute.ALL) -> CallPlan:
        ranks = [0] if execute == Execute.RANK_ZERO else list(range(layout.world_size))
        args = tuple(broadcast_value(a) for a in args)
        kwargs = {k: broadcast_value(v) for k, v in kwargs.items()}
        merge = (lambda outputs: outputs[0]) if execute == Execute.RANK_ZERO else list
        return CallPlan([RankCall(rank, args, kwargs) for rank in ranks], merge)


class AllToAll:
    name = Dispatch.ALL_TO_ALL.value

    def plan(self, layout: Layout, args: tuple, kwargs: dict, execute: Execute = Execute.ALL) -> CallPlan:
        size = layout.world_size
        for position, value in [*enumerate(args), *kwargs.items()]:
            if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) != size:
                raise ValueError(
                    f"ALL_TO_ALL needs every argument to be a sequence of one value per worker ({size}); "
                    f"argument {position!r} is {type(value).__name__}"
                    + (f" of length {len(value)}" if isinstance(value, Sequence) else "")
                )
        calls = [
            RankCall(rank, tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()})
            for rank in range(size)
        ]
        return CallPlan(calls, list)


class RankZero:
    name = Dispatch.RANK_ZERO.value

    def plan(self, layout: Layout, args: tuple, kwargs: dict, execute: Execute = Execute.ALL) -> CallPlan:
        return OneToAll().plan(layout, args, kwargs, Execute.RANK_ZERO)


class DataParallelProto:
    name = Dispatch.DP_COMPUTE_PROTO.value

    def plan(self, layout: Layout, args: tuple, kwargs: dict, execute: Execute = Execute.ALL) -> CallPlan:
        size = layout.world_size
        per_args, per_kwargs, pads = split_data_parallel(args, kwargs, size)
        calls = [RankCall(rank, per_args[rank], per_kwargs[rank], pads[rank]) for rank in range(size)]
        return CallPlan(calls, concat_outputs, shard_positions=list(range(size)))


class DataParallelMesh:
    """Data split over the data-parallel ranks only; one output per DP group (see :class:`Dispatch`)."""

    name = Dispatch.DP_MESH.value

    def plan(self, layout: Layout, args: tuple, kwargs: dict, execute: Execute = Execute.ALL) -> CallPlan:
        per_args, per_kwargs, pads = split_data_parallel(args, kwargs, layout.dp_size)
        calls = [
            RankCall(rank, per_args[layout.dp_rank[rank]], per_kwargs[layout.dp_rank[rank]], pads[layout.dp_rank[rank]])
            for rank in range(layout.world_size)
        ]
        collecting = sorted((layout.dp_rank[rank], rank) for rank in range(layout.world_size) if layout.collect[rank])
        if [dp for dp, _ in collecting] != list(range(layout.dp_size)):
            raise ValueError(
                f"DP_MESH needs exactly one collecting worker per data-parallel rank 0..{layout.dp_size - 1}; "
                f"workers declared {[dp for dp, _ in collecting]}"
            )
        order = [position for _, position in collecting]
        return CallPlan(calls, lambda outputs: concat_outputs([outputs[i] for i in order]), shard_positions=order)

