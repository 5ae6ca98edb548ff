"""``@register``: makes a worker method callable on its ``WorkerGroup`` from the driver."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

ATTRIBUTE = "__rlplat_method__"


class Dispatch(str, enum.Enum):
    """Built-in dispatch modes; any name registered under kind ``dispatch_mode`` works too.

    ``ONE_TO_ALL``: every worker gets the same arguments; the result is the list of their outputs.
    ``ALL_TO_ALL``: every argument is a sequence of one value per worker; the result is the list.
    ``DP_COMPUTE_PROTO``: DataProto arguments are padded to a multiple of the world size and split
    over the workers, other arguments are broadcast; the outputs are concatenated and the padding
    removed, so the caller gets exactly one output row per input row (or ``k`` per row, in order).
    ``RANK_ZERO``: only rank 0 is called; the result is its output.
    ``DP_MESH``: like ``DP_COMPUTE_PROTO`` over the data-parallel ranks that workers declare with
    :meth:`Worker.set_dispatch_info`; workers of one DP group get the same shard and the output is
    taken from the one worker per group that declares ``collect=True``.
    """

    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    RANK_ZERO = "RANK_ZERO"
    DP_MESH = "DP_MESH"


class Execute(str, enum.Enum):
    """Which workers run the method: ``ALL`` of them, or ``RANK_ZERO`` only."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    dispatch_mode: str
    execute_mode: Execute
    blocking: bool


def register(
    dispatch_mode: Dispatch | str = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | str = Execute.ALL,
    blocking: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a :class:`~rlplat.controller.worker.Worker` method as callable from the driver.

    The worker group then has a method of the same name that splits the arguments by
    ``dispatch_mode`` (a :class:`Dispatch` or a registered ``dispatch_mode`` name), calls the workers
    chosen by ``execute_mode`` and merges their outputs. With ``blocking=False`` it returns a
    :class:`~rlplat.controller.worker_group.DataFuture` instead, which can be passed straight into
    another call: the workers then fetch their part from the object store themselves.
    """
    mode = dispatch_mode.value if isinstance(dispatch_mode, Dispatch) else str(dispatch_mode)
    execute = Execute(execute_mode)

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        setattr(function, ATTRIBUTE, MethodSpec(mode, execute, blocking))
        return function

    return decorate


def registered_methods(worker_class: type) -> dict[str, MethodSpec]:
    """Name -> spec of every ``@register``-ed method of ``worker_class`` (inherited ones included)."""
    methods: dict[str, MethodSpec] = {}
    for klass in reversed(worker_class.__mro__):
        for name, value in vars(klass).items():
            spec = getattr(value, ATTRIBUTE, None)
            if spec is not None:
                methods[name] = spec
            elif name in methods and callable(value):
                del methods[name]  # overridden without @register: no longer remote
    return methods
