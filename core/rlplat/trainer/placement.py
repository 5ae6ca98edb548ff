"""Building the run's worker groups from its roles (kind ``role``) and placing their processes.

:func:`enabled_roles` asks every registered role whether the run needs it; :func:`place` builds one
worker group per enabled role: the colocated ones share the actor's processes (``cluster.nnodes`` x
``cluster.devices_per_node``, or the one in-process worker of the local backend), each separate one gets a
resource pool of its own (``roles.<name>.nnodes`` x ``roles.<name>.devices_per_node``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlplat.contracts.role import Role, RunContext


@dataclasses.dataclass
class Placement:
    """The run's worker groups by role name, and the resource pools that hold them."""

    groups: dict[str, Any]
    roles: dict[str, Role]
    pools: list[Any] = dataclasses.field(default_factory=list)

    def shutdown(self) -> None:
        """Stop every group's processes, then give the pools' bundles back."""
        for group in self.groups.values():
            group.shutdown()
        for pool in self.pools:
            pool.release()


def enabled_roles(run: RunContext) -> dict[str, Role]:
    """Every registered role this run needs, ``actor`` first, then by name."""
    from rlplat import registry

    roles = {name: registry.get("role", name)() for name in registry.names("role")}
    ordered = sorted(roles, key=lambda name: (name != "actor", name))
    return {name: roles[name] for name in ordered if roles[name].enabled(run)}


def place(roles: dict[str, Role], run: RunContext) -> Placement:
    """One worker group per role; see the module docstring. Nothing is initialised yet (``init_model``)."""
    cluster = run.config.cluster
    specs, separate = {}, {}
    for name, role in roles.items():
        settings = role.settings(run, name)
        if settings.placement == "separate":
            separate[name] = (role.worker(run), settings, role.concurrent_calls(run))
        else:
            specs[name] = role.worker(run)
    if cluster.backend == "local":
        from rlplat.controller.local_backend import LocalWorkerGroup

        if separate:
            raise ValueError(f"roles {sorted(separate)} are placed separately, which needs cluster.backend=ray")
        if cluster.threads_per_process:
            from rlplat.controller.host import set_threads

            set_threads(cluster.threads_per_process)
        return Placement(LocalWorkerGroup.colocated(specs, use_gpu=cluster.use_gpu), roles)
    from rlplat.controller.ray_backend import RayWorkerGroup, ResourcePool, start_ray

    start_ray(cluster.address, py_modules=cluster.py_modules, runtime_env=cluster.runtime_env,
              ship_driver_modules=cluster.ship_driver_modules)
    pool = ResourcePool([cluster.devices_per_node] * cluster.nnodes, use_gpu=cluster.use_gpu,
                        cpus_per_process=cluster.cpus_per_process, threads_per_process=cluster.threads_per_process)
    placement = Placement(RayWorkerGroup.colocated(pool, specs), roles, [pool])
    for name, (spec, settings, concurrent) in separate.items():
        own = ResourcePool([settings.devices_per_node or cluster.devices_per_node] * (settings.nnodes or cluster.nnodes),
                           use_gpu=cluster.use_gpu, cpus_per_process=cluster.cpus_per_process, name_prefix=f"rlplat_{name}",
                           threads_per_process=cluster.threads_per_process)
        placement.pools.append(own)
        placement.groups[name] = RayWorkerGroup(own, spec, role=name, concurrent_calls=concurrent)
    return placement
