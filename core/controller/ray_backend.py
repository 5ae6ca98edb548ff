"""The Ray backend: placement groups per node, one host actor per bundle, failures reported at once.

``start_ray()`` starts a local cluster (dashboard off, bound to 127.0.0.1, token auth off) or joins an
existing one with ``address=``. ``ResourcePool`` reserves bundles; ``RayWorkerGroup`` puts one worker
process on each, in a rank order that is stable across restarts (sorted by node address, then bundle).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlplat.controller.dispatch import RankCall
from rlplat.controller.host import WorkerHost, WorkerSpec
from rlplat.controller.worker_group import WorkerError, WorkerGroup

PLACEMENT_TIMEOUT_S = float(os.environ.get("RLPLAT_PLACEMENT_TIMEOUT_S", "120"))


def start_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Join the cluster at ``address``, or start a local one; does nothing if Ray is already up."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # Ray turns 127.0.0.1 into the machine's routable address unless cluster mode is off; the switch is
    # an environment variable for the processes Ray starts, and a constant Ray read at import here.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        address="local",  # a new cluster even if another one on this machine is recorded as current
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        log_to_driver=True,
    )


class ResourcePool:
    """Where a worker group's processes go: ``process_on_nodes[i]`` processes on node ``i``.

    Each process gets a bundle of ``cpus_per_process`` CPUs (and one GPU with ``use_gpu``). Worker
    groups built on the same pool share its bundles; with ``max_colocate_count=k`` up to ``k`` groups'
    processes share one bundle, each taking ``1/k`` of its CPUs and GPU (fractional sharing).
    """

    def __init__(self, process_on_nodes: Sequence[int], use_gpu: bool = False, max_colocate_count: int = 1,
                 cpus_per_process: float = 1.0, name_prefix: str = "rlplat"):
        if not process_on_nodes or any(count < 1 for count in process_on_nodes):
            raise ValueError(f"process_on_nodes needs one positive count per node, got {list(process_on_nodes)}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.cpus_per_process = cpus_per_process
        self.name_prefix = name_prefix
        self._slots: list[tuple[Any, int, str, int]] | None = None
        self._groups: list[Any] = []

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_process, **({"GPU": 1.0} if self.use_gpu else {})}

    def slots(self) -> list[tuple[Any, int, str, int]]:
        """``(placement group, bundle index, node address, local rank)`` per rank, in rank order."""
        if self._slots is None:
            start_ray()
            groups = [
                placement_group([self.bundle()] * count, strategy="STRICT_PACK", name=f"{self.name_prefix}_{uuid.uuid4().hex[:8]}_{index}")
                for index, count in enumerate(self.process_on_nodes)
            ]
            ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=PLACEMENT_TIMEOUT_S)
            if len(ready) != len(groups):
                for group in groups:
                    remove_placement_group(group)
                raise RuntimeError(
                    f"could not reserve {self.process_on_nodes} processes with {self.bundle()} each within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()} "
                    f"(free now: {ray.available_resources()})"
                )
            self._groups = groups
            addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
            placed = []
            for group in groups:
                node_of_bundle = placement_group_table(group)["bundles_to_node_id"]
                node = node_of_bundle[0]
                placed.append((addresses.get(node, ""), node, group))
            placed.sort(key=lambda item: (item[0], item[1]))
            self._slots = [
                (group, bundle_index, address, bundle_index)
                for address, _, group in placed
                for bundle_index in range(len(placement_group_table(group)["bundles"]))
            ]
        return self._slots

    def release(self) -> None:
        """Give the bundles back to the cluster (after every group on the pool is shut down)."""
        for group in self._groups:
            remove_placement_group(group)
        self._groups, self._slots = [], None


class RayBackend:
    def __init__(self, hosts: list[Any]):
        self.hosts = hosts
        self.alive = True

    def submit(self, role: str, method: str, calls: list[RankCall], data_parallel: bool) -> tuple[list, list]:
        results, pads = [], []
        for call in calls:
            remote = self.hosts[call.rank].call
            if data_parallel:
                output, pad = remote.options(num_returns=2).remote(role, method, call.args, call.kwargs, call.pad_rows)
                pads.append(pad)
            else:
                output = remote.remote(role, method, call.args, call.kwargs, None)
            results.append(output)
        return results, pads

    def wait(self, refs: list, calls: list[RankCall], label: str) -> list:
        """Values of ``refs``; the first failure raises at once, even while other ranks still run."""
        role, _, method = label.partition(".")
        position = {ref: index for index, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                index = position[ref]
                try:
                    values[index] = ray.get(ref)
                except ray.exceptions.RayTaskError as error:
                    cause = error.cause if getattr(error, "cause", None) is not None else error
                    raise WorkerError(role, calls[index].rank, method, f"{type(cause).__name__}: {cause}",
                                      getattr(error, "traceback_str", "") or str(error)) from error
                except ray.exceptions.RayActorError as error:
                    raise WorkerError(role, calls[index].rank, method,
                                      f"the worker process died ({type(error).__name__}): {error}") from error
        return values

    def dispatch_infos(self, role: str) -> list[tuple[int, int, bool]]:
        refs = [host.dispatch_info.remote(role) for host in self.hosts]
        return self.wait(refs, [RankCall(rank, (), {}) for rank in range(len(self.hosts))], f"{role}.dispatch_info")

    def pids(self) -> list[int]:
        return ray.get([host.pid.remote() for host in self.hosts])

    def shutdown(self) -> None:
        if not self.alive:
            return
        self.alive = False
        try:
            ray.wait([host.shutdown.remote() for host in self.hosts], num_returns=len(self.hosts), timeout=10)
        finally:
            for host in self.hosts:
                ray.kill(host)


def start_hosts(pool: ResourcePool, init_distributed: bool = True) -> RayBackend:
    """One host actor per bundle of ``pool``, with ``torch.distributed`` set up across them."""
    slots = pool.slots()
    share = 1.0 / pool.max_colocate_count
    host_class = ray.remote(WorkerHost)
    hosts = [
        host_class.options(
            num_cpus=pool.cpus_per_process * share,
            num_gpus=share if pool.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle),
        ).remote(rank, len(slots), local_rank, ray.get)
        for rank, (group, bundle, _, local_rank) in enumerate(slots)
    ]
    backend = RayBackend(hosts)
    calls = [RankCall(rank, (), {}) for rank in range(len(hosts))]
    master_address, master_port, _ = backend.wait([hosts[0].address.remote()], calls[:1], "host.address")[0]
    if init_distributed:
        backend.wait([host.init_distributed.remote(master_address, master_port, pool.use_gpu) for host in hosts],
                     calls, "host.init_distributed")
    return backend


class RayWorkerGroup(WorkerGroup):
    """A worker per bundle of ``pool``: ``RayWorkerGroup(pool, WorkerSpec(ActorWorker, config), role="actor")``."""

    def __init__(self, pool: ResourcePool, spec: WorkerSpec | type, role: str = "worker", *,
                 init_distributed: bool = True, _backend: RayBackend | None = None):
        spec = spec if isinstance(spec, WorkerSpec) else WorkerSpec(spec)
        backend = _backend or start_hosts(pool, init_distributed)
        calls = [RankCall(rank, (), {}) for rank in range(len(backend.hosts))]
        backend.wait([host.create.remote(role, spec) for host in backend.hosts], calls, f"{role}.__init__")
        self.pool = pool
        super().__init__(role, spec.cls, backend, world_size=len(backend.hosts))

    @classmethod
    def colocated(cls, pool: ResourcePool, roles: Mapping[str, WorkerSpec], *, init_distributed: bool = True) -> dict[str, "RayWorkerGroup"]:
        """Several roles in the same processes (one per bundle), one group per role; method names of
        different roles may coincide."""
        backend = start_hosts(pool, init_distributed)
        return {role: cls(pool, spec, role, _backend=backend) for role, spec in roles.items()}

    def pids(self) -> list[int]:
        """Process id of each rank's worker."""
        return self.backend.pids()
