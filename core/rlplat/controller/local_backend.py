"""The in-process backend: world size 1, the worker lives in the driver process.

Calls run synchronously in the caller's thread, so ``breakpoint()`` inside a worker method works and
tracebacks are ordinary. Non-blocking calls return an already-completed future.
"""

from __future__ import annotations

import traceback
from typing import Any, Mapping

from rlplat.controller.dispatch import RankCall
from rlplat.controller.host import WorkerHost, WorkerSpec, free_port
from rlplat.controller.worker_group import WorkerError, WorkerGroup


class LocalBackend:
    """The one process of the local groups (this one) and its host."""

    def __init__(self, host: WorkerHost, use_gpu: bool):
        self.host = host
        self.use_gpu = use_gpu

    def wait(self, values: list, calls: list[RankCall], label: str) -> list:
        return list(values)

    def dispatch_infos(self, role: str) -> list[tuple[int, int, bool]]:
        return [self.host.dispatch_info(role)]

    def host_calls(self, method: str, *args: Any) -> list[Any]:
        """``WorkerHost.method(*args)`` of this process's host, as a one-element list."""
        return [getattr(self.host, method)(*args)]

    def shutdown(self) -> None:
        self.host.shutdown()


class LocalWorkerGroup(WorkerGroup):
    """One worker, in this process: ``LocalWorkerGroup(WorkerSpec(ActorWorker, config), role="actor")``."""

    def __init__(self, spec: WorkerSpec | type, role: str = "worker", *, use_gpu: bool = False,
                 init_distributed: bool = True, _backend: LocalBackend | None = None):
        spec = spec if isinstance(spec, WorkerSpec) else WorkerSpec(spec)
        backend = _backend or self.start_backend(use_gpu, init_distributed)
        backend.host.create(role, spec)
        super().__init__(role, spec.cls, backend, world_size=1)

    def submit(self, method: str, calls: list[RankCall], data_parallel: bool) -> tuple[list, list]:
        results, pads = [], []
        for call in calls:
            try:
                output = self.backend.host.call(self.role, method, call.args, call.kwargs, call.pad_rows if data_parallel else None)
            except Exception as error:
                raise WorkerError(self.role, call.rank, method, f"{type(error).__name__}: {error}", traceback.format_exc()) from error
            if data_parallel:
                output, pad = output
                pads.append(pad)
            results.append(output)
        return results, pads

    @staticmethod
    def start_backend(use_gpu: bool, init_distributed: bool) -> LocalBackend:
        host = WorkerHost(rank=0, world_size=1)
        if init_distributed:
            host.init_distributed("127.0.0.1", free_port(), use_gpu)
        return LocalBackend(host, use_gpu)

    @classmethod
    def colocated(cls, roles: Mapping[str, WorkerSpec], *, use_gpu: bool = False, init_distributed: bool = True) -> dict[str, "LocalWorkerGroup"]:
        """Several roles in this one process, one group per role."""
        backend = cls.start_backend(use_gpu, init_distributed)
        return {role: cls(spec, role, _backend=backend) for role, spec in roles.items()}
