"""``WorkerGroup``: the driver's handle on the workers of one role.

Every ``@register``-ed method of the worker class becomes a method of the group (same name). A call
asks the method's dispatch mode for a plan, hands each rank its part through the backend, and merges
the outputs; ``blocking=False`` methods (or :meth:`WorkerGroup.call_async`) return a
:class:`~rlplat.controller.dispatch.DataFuture`.
"""

from __future__ import annotations

import functools
from typing import Any

from rlplat.controller.decorator import Dispatch, MethodSpec, registered_methods
from rlplat.controller.dispatch import CallPlan, DataFuture, Layout, RankCall


class WorkerError(RuntimeError):
    """A worker failed: ``role``, ``rank``, ``method`` and the cause (with the remote traceback)."""

    def __init__(self, role: str, rank: int, method: str, cause: str, remote_traceback: str = ""):
        self.role, self.rank, self.method, self.cause = role, rank, method, cause
        self.remote_traceback = remote_traceback
        message = f"worker {role!r} rank {rank} failed in {method}(): {cause}"
        if remote_traceback:
            message += f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(message)


def dispatch_mode(name: str) -> Any:
    """The mode object registered as ``name`` (kind ``dispatch_mode``; rlplat registers the built-ins)."""
    from rlplat import registry

    mode = registry.get("dispatch_mode", name)
    return mode() if isinstance(mode, type) else mode


class WorkerGroup:
    """Base of the backends' groups: ``backend`` holds the processes the group's calls run in, which colocated
    groups share (``wait``, ``dispatch_infos``, ``host_calls``, ``shutdown``). The built-in groups hand each
    rank its call themselves (:meth:`submit`, the driver's last frame before the worker); a group on a
    backend of its own making may leave that to the backend's ``submit(role, method, calls, data_parallel)``."""

    def __init__(self, role: str, worker_class: type, backend: Any, world_size: int):
        self.role = role
        self.worker_class = worker_class
        self.backend = backend
        self.world_size = world_size
        self._layout: Layout | None = None
        self._methods = registered_methods(worker_class)
        for name, spec in self._methods.items():
            if hasattr(WorkerGroup, name):
                raise TypeError(f"{worker_class.__name__}.{name} clashes with a WorkerGroup attribute; rename it")
            setattr(self, name, functools.partial(self._invoke, name, spec))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, worker={self.worker_class.__name__}, world_size={self.world_size})"

    @property
    def method_names(self) -> list[str]:
        return sorted(self._methods)

    def layout(self, refresh: bool = False) -> Layout:
        """Each rank's data-parallel place, as the workers declared it (asked once, then cached)."""
        if self._layout is None or refresh:
            infos = self.backend.dispatch_infos(self.role)
            dp_sizes = {dp_size for _, dp_size, _ in infos}
            if len(dp_sizes) != 1:
                raise ValueError(f"workers of {self.role!r} declared different dp sizes {sorted(dp_sizes)}")
            self._layout = Layout(
                self.world_size,
                tuple(dp_rank for dp_rank, _, _ in infos),
                dp_sizes.pop(),
                tuple(collect for _, _, collect in infos),
            )
        return self._layout

    def _invoke(self, name: str, spec: MethodSpec, *args: Any, **kwargs: Any) -> Any:
        future = self._submit(name, spec, args, kwargs)
        return future.get() if spec.blocking else future

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> DataFuture:
        """Call a registered method without waiting, whatever its ``blocking`` flag says."""
        if name not in self._methods:
            raise AttributeError(f"{self.worker_class.__name__} has no registered method {name!r}; it has {self.method_names}")
        return self._submit(name, self._methods[name], args, kwargs)

    def call_rank(self, rank: int, name: str, *args: Any, **kwargs: Any) -> DataFuture:
        """Call a registered method on rank ``rank`` alone with the whole arguments, without waiting: each
        process of the group serving as a replica of its own (e.g. a rollout generating one batch while
        another process generates the next). The result is that rank's output."""
        if name not in self._methods:
            raise AttributeError(f"{self.worker_class.__name__} has no registered method {name!r}; it has {self.method_names}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.role}: rank {rank} is out of range for a group of {self.world_size} process(es)")
        plan = CallPlan([RankCall(rank, args, kwargs, 0)], merge=lambda outputs: outputs[0], shard_positions=[0])
        results, pads = self.submit(name, plan.calls, True)
        return DataFuture(self.backend, plan, results, pads, f"{self.role}.{name}")

    def _submit(self, name: str, spec: MethodSpec, args: tuple, kwargs: dict) -> DataFuture:
        mode = dispatch_mode(spec.dispatch_mode)
        needs_declared_layout = spec.dispatch_mode == Dispatch.DP_MESH.value or getattr(mode, "needs_layout", False)
        layout = self.layout() if needs_declared_layout else Layout.flat(self.world_size)
        plan: CallPlan = mode.plan(layout, args, kwargs, spec.execute_mode)
        data_parallel = plan.shard_positions is not None
        results, pads = self.submit(name, plan.calls, data_parallel)
        return DataFuture(self.backend, plan, results, pads, f"{self.role}.{name}")

    def submit(self, method: str, calls: list[RankCall], data_parallel: bool) -> tuple[list, list]:
        """Start ``method`` on each call's rank: the results (or the backend's handles on them) and, for a
        data-parallel call, the padding each rank added, in call order."""
        submit = getattr(self.backend, "submit", None)
        if submit is None:
            raise TypeError(f"{type(self).__name__} neither overrides WorkerGroup.submit nor has a backend with submit() "
                            f"({type(self.backend).__name__})")
        return submit(self.role, method, calls, data_parallel)

    def shutdown(self) -> None:
        """Stop this group's processes (for colocated groups: the shared processes)."""
        self.backend.shutdown()


__all__ = ["RankCall", "WorkerError", "WorkerGroup"]
