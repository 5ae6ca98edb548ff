"""``WorkerHost``: the process-side runtime that holds one or more role workers (colocation).

Under Ray each host is an actor; in process it is a plain object. It sets the process environment
(rank, world size), sets up ``torch.distributed`` once per process, builds each role's worker, and
runs calls: fetching :class:`Shard` arguments from the object store itself and counting the padding
rows of its data-parallel outputs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import socket
from datetime import timedelta
from typing import Any, Callable

from rlplat.controller import timeline
from rlplat.controller.dispatch import Shard, WholeValue, padding_in_parts, trim
from rlplat.controller.worker import ENV_ROLE
from rlplat.protocol import DataProto


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """A worker class with the arguments to build it: ``WorkerSpec(ActorWorker, config)``."""

    cls: type
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def cores_share(processes_on_node: int) -> int:
    """This process's share of the cores it may run on: ``cores // processes_on_node``, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes_on_node))


def set_threads(threads: int) -> int:
    """torch's intra-op threads of this worker process (and OpenMP's, for libraries that read it).
    Too many threads per process on shared cores wait on each other at every barrier; too few leave
    cores idle."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def follow_threads(threads: int) -> None:
    """Give the calling thread ``threads`` torch (OpenMP) threads. OpenMP keeps the count per thread: a thread
    started after :func:`set_threads` (a pool thread of a Ray actor, a rollout's own loop) starts from the
    process's default, and kernels that size their work in one thread and run it in another disagree."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class WorkerHost:
    """See the module docstring. ``fetch`` turns object references into values (``ray.get`` under Ray)."""

    def __init__(self, rank: int, world_size: int, local_rank: int = 0, fetch: Callable[[list], list] | None = None,
                 processes_on_node: int | None = None, threads: int | None = None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.set_environment()
        self.threads: int | None = None
        if processes_on_node is not None or threads is not None:
            self.threads = set_threads(threads or cores_share(processes_on_node or 1))
        self.fetch = fetch or (lambda values: list(values))
        self.workers: dict[str, Any] = {}
        self.owns_process_group = False

    def set_environment(self, role: str | None = None) -> None:
        """The variables :class:`Worker` and ``torch.distributed`` read (set again before each role is built)."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank))
        if role is not None:
            os.environ[ENV_ROLE] = role

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def address(self) -> tuple[str, int, int]:
        """``(ip, free port, pid)`` of this process: rank 0's becomes the rendezvous address."""
        return node_address(), free_port(), os.getpid()

    def init_distributed(self, master_address: str, master_port: int, use_gpu: bool, timeout_s: float = 600) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            return
        os.environ.update(MASTER_ADDR=master_address, MASTER_PORT=str(master_port))
        if use_gpu:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(f"cluster.use_gpu=true, but worker process {self.rank} (pid {os.getpid()}) sees no "
                                   f"CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}): set "
                                   "cluster.use_gpu=false or auto to run the workers as CPU processes.")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.device_count() > 1 else 0)
        dist.init_process_group(
            backend="nccl" if use_gpu else "gloo",
            init_method=f"tcp://{master_address}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.owns_process_group = True

    def create(self, role: str, spec: WorkerSpec) -> None:
        if role in self.workers:
            raise ValueError(f"role {role!r} already lives in this process")
        self.set_environment(role)
        self.workers[role] = spec.cls(*spec.args, **spec.kwargs)

    def dispatch_info(self, role: str) -> tuple[int, int, bool]:
        return self.workers[role].dispatch_info()

    def call(self, role: str, method: str, args: tuple, kwargs: dict, pad_rows: int | None = None) -> Any:
        """Run ``role.method``. For a data-parallel call (``pad_rows`` not None) returns
        ``(output, padding rows at its end)``: the output keeps the padding so that a chained call gets
        equal shards; whoever materialises the result drops the padding rows."""
        learned: list[int] = []
        args = tuple(self.resolve(value, learned) for value in args)
        kwargs = {key: self.resolve(value, learned) for key, value in kwargs.items()}
        pad_in = 0 if pad_rows is None else (learned[0] if pad_rows == -1 and learned else max(pad_rows, 0))
        worker = self.workers[role]
        if self.threads is not None:
            follow_threads(self.threads)  # a host running calls at once runs them on threads of a pool
        worker.padding_rows = pad_in
        try:
            with timeline.span(f"{role}.{method}", "worker", rank=self.rank):
                output = getattr(worker, method)(*args, **kwargs)
        finally:
            worker.padding_rows = 0
        if pad_rows is None:
            return output
        if not pad_in or not isinstance(output, DataProto):
            return output, 0
        rows_in = next(len(v) for v in (*args, *kwargs.values()) if isinstance(v, DataProto))
        if len(output) % rows_in:
            raise ValueError(
                f"{role}.{method} returned {len(output)} rows for {rows_in} input rows; a data-parallel "
                "method must return a whole number of rows per input row so that padding can be removed"
            )
        return output, pad_in * (len(output) // rows_in)

    def resolve(self, value: Any, learned: list[int]) -> Any:
        """Fetch a Shard or WholeValue argument here, in the worker, never through the driver."""
        if isinstance(value, WholeValue):
            return value.merge(self.fetch(value.results))
        if not isinstance(value, Shard):
            return value
        sources = self.fetch(value.sources)
        pads = [pad if isinstance(pad, int) else None for pad in value.pads]
        if any(pad is None for pad in pads):
            pads = self.fetch(value.pads)
        if value.part is None:
            learned.append(pads[0])
            return sources[0]
        whole = DataProto.concat([trim(source, pad) for source, pad in zip(sources, pads)])
        index, count = value.part
        padded, _ = whole.pad_to_divisor(count)
        learned.append(padding_in_parts(len(whole), len(padded), count)[index])
        return padded.chunk(count)[index]

    def pid(self) -> int:
        return os.getpid()

    def profile(self, start: bool, torch_dir: str | None = None) -> dict[str, Any] | None:
        """Start recording this process's timeline (:mod:`rlplat.controller.timeline`; with ``torch_dir``, a
        ``torch.profiler`` trace too), or stop it and return ``{"pid", "rank", "roles", "spans"}``, the
        torch trace written to ``torch_dir/torch_rank<rank>_pid<pid>.json``."""
        if start:
            timeline.start()
            if torch_dir is not None:
                import torch

                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.torch_profiler = torch.profiler.profile(activities=activities)
                self.torch_profiler.__enter__()
            return None
        profiler, self.torch_profiler = getattr(self, "torch_profiler", None), None
        if profiler is not None:
            profiler.__exit__(None, None, None)
            os.makedirs(torch_dir or ".", exist_ok=True)
            profiler.export_chrome_trace(os.path.join(torch_dir or ".", f"torch_rank{self.rank}_pid{os.getpid()}.json"))
        return {"pid": os.getpid(), "rank": self.rank, "roles": sorted(self.workers), "spans": timeline.stop()}

    def shutdown(self) -> None:
        """Close the workers this host holds (those that define ``close``: engines that run processes or
        process groups of their own stop them while this process's group still exists), then destroy the
        process group this host created (before the process is killed). A worker whose ``close`` fails is
        reported and the others are still closed."""
        for role, worker in list(self.workers.items()):
            close = getattr(worker, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as error:  # shutting down: the next worker and the group still need closing
                    print(f"rlplat: closing the {role} worker failed: {type(error).__name__}: {error}", file=sys.stderr)
        if self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_process_group = False
