"""The Ray backend: placement groups per node, one host actor per bundle, failures reported at once.

``start_ray()`` starts a local cluster (dashboard off, bound to 127.0.0.1, token auth off) or joins an
existing one with ``address=``, and ships the user's own modules to every worker through the job's
runtime environment (``py_modules=``, ``runtime_env=``, and the driver's own code by default).
``ResourcePool`` reserves bundles; ``RayWorkerGroup`` puts one worker process on each, in a rank order
that is stable across restarts (sorted by node address, then bundle).
"""

from __future__ import annotations

import collections

import copy
import importlib.metadata
import importlib.util
import logging
import os
import shlex
import site
import sys
import uuid
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

import ray
from ray.runtime_env import RuntimeEnv
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlplat.config_node import did_you_mean
from rlplat.controller.dispatch import RankCall
from rlplat.controller.host import WorkerHost, WorkerSpec
from rlplat.controller.worker_group import WorkerError, WorkerGroup

PLACEMENT_TIMEOUT_S = float(os.environ.get("RLPLAT_PLACEMENT_TIMEOUT_S", "120"))
DRIVER_PACKAGE_MAX_BYTES = 20 << 20
"""A package of the driver's folder larger than this is not shipped by default (name it to ship it)."""

logger = logging.getLogger(__name__)
_runtime_env_of_job: dict[str, dict[str, Any]] = {}  # Ray job id -> the runtime env start_ray gave it


def start_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None, *,
              py_modules: Sequence[Any] = (), runtime_env: Mapping[str, Any] | None = None,
              ship_driver_modules: bool = True) -> None:
    """Join the cluster at ``address`` (``"auto"``, ``"host:port"``), or start a local one, with the
    user's code on every worker; does nothing if Ray is already up in this process.

    Workers unpickle what the driver sends them. cloudpickle sends the classes and functions of the
    ``__main__`` script by value, but those of an importable module by name, so a loss, a worker class
    or a reward defined in a module of yours that is not installed fails in the worker with
    ``ModuleNotFoundError`` unless the module is there. Ray puts the driver's script folder and current
    directory on the workers' ``sys.path``, but only where that path exists: on the same machine.

    * ``py_modules``: modules to ship, as import names (``"my_losses"``, ``"my_package"``; a dotted
      name ships its whole top-level package), module objects, local paths (a package folder or a
      ``.py`` file; a name with a ``/`` or ending in ``.py`` is a path) or URIs Ray fetches itself.
    * ``runtime_env``: more of Ray's runtime environment for every worker process (``env_vars``,
      ``pip``, ``working_dir``, ``excludes``, ...); its own ``py_modules`` are passed on as they are,
      and ``env_vars`` values are turned into strings.
    * ``ship_driver_modules``: also ship the driver's own code, as :func:`driver_modules` finds it
      (modules imported from the ``__main__`` script's folder that no distribution installs).

    Why the job's runtime environment: Ray uploads each module once to the cluster, and every node
    that starts a worker of this job (another machine, one that joins later) unpacks it onto
    ``sys.path``, so the modules import by name there as installed ones do: with their imports of one
    another, their import-time code (registrations, constants) and references by name (``WorkerSpec``
    classes, functions given as dotted paths). ``cloudpickle.register_pickle_by_value`` needs no upload, but ships only
    the registered module's own classes and functions, inside every pickled object, while whatever
    they import from another module of yours still travels by name and fails; it is not used.

    The runtime environment belongs to Ray's job and is fixed when Ray starts in this process: asking
    for modules or settings Ray was not started with raises ``RuntimeError``; call ``start_ray`` with
    them before anything starts Ray, or ``ray.shutdown()`` first. A ``py_modules`` entry that cannot
    be found raises ``ValueError`` naming it, before anything starts.
    """
    requested = worker_runtime_env(py_modules, runtime_env)
    if ray.is_initialized():
        require_runtime_env(requested)
        return
    environment = dict(requested)
    if ship_driver_modules:
        shipped = set(environment.get("py_modules", []))
        driver = [path for path in driver_modules() if path not in shipped]
        if driver:
            logger.info("start_ray: shipping the driver's modules to the workers: %s", ", ".join(driver))
            environment["py_modules"] = [*environment.get("py_modules", []), *driver]
    runtime = {"runtime_env": copy.deepcopy(environment)} if environment else {}  # Ray rewrites it in place
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, log_to_driver=True, **runtime)
    else:
        runtime = quoted_interpreter(runtime)
        # Ray turns 127.0.0.1 into the machine's routable address unless cluster mode is off; the switch
        # is an environment variable for the processes Ray starts, and a constant Ray read at import here.
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
            **runtime,
        )
    _runtime_env_of_job[ray.get_runtime_context().get_job_id()] = environment


#: runtime_env settings that choose the workers' interpreter themselves.
OWN_INTERPRETER = ("py_executable", "pip", "uv", "conda", "container", "image_uri")


def quoted_interpreter(runtime: dict[str, Any]) -> dict[str, Any]:
    """``ray.init``'s arguments for a local cluster whose workers start through a runtime environment: Ray
    then starts each worker with ``bash -c "exec <interpreter> ..."`` and leaves the interpreter's path
    unquoted (its ``py_executable`` is a shell fragment, like ``uv run``), so a path with a space or a
    shell character (a clone in ``~/my projects``) failed every worker's start. This one's quoted path is
    given as ``py_executable`` unless a setting chooses the interpreter itself."""
    environment = runtime.get("runtime_env")
    quoted = shlex.quote(sys.executable)
    if not environment or quoted == sys.executable or any(key in environment for key in OWN_INTERPRETER):
        return runtime
    return {**runtime, "runtime_env": {**environment, "py_executable": quoted}}


def require_runtime_env(requested: Mapping[str, Any]) -> None:
    """Raise ``RuntimeError`` if the running Ray job lacks a module or a setting of ``requested``."""
    if not requested:
        return
    given = _runtime_env_of_job.get(ray.get_runtime_context().get_job_id())
    if given is None:
        missing = dict(requested)
    else:
        missing = {key: value for key, value in requested.items() if key != "py_modules" and given.get(key) != value}
        modules = [module for module in requested.get("py_modules", []) if module not in given.get("py_modules", [])]
        if modules:
            missing["py_modules"] = modules
    if missing:
        started = "by start_ray without them" if given is not None else "outside start_ray"
        raise RuntimeError(
            f"Ray is already running in this process (started {started}) and a job's runtime environment is "
            f"fixed when Ray starts, so these cannot reach the workers now: {missing}. Call start_ray(...) "
            "with them before anything starts Ray, or ray.shutdown() first."
        )


def worker_runtime_env(py_modules: Sequence[Any] = (), runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The runtime environment ``start_ray`` asks Ray for: ``runtime_env`` with ``py_modules``
    resolved (:func:`resolve_py_module`) and appended to its own, and ``env_vars`` as strings.

    Raises ``ValueError`` naming the entry (``py_modules[1]: ...``, ``runtime_env.envvars: ...``) when
    a module cannot be found or Ray refuses a setting."""
    environment = plain(dict(runtime_env or {}))
    unknown = [key for key in environment if key not in RuntimeEnv.known_fields]
    if unknown and not os.environ.get("RAY_RUNTIME_ENV_PLUGINS"):
        raise ValueError(f"runtime_env.{unknown[0]}: not a setting of Ray's runtime environment."
                         f"{did_you_mean(unknown[0], sorted(RuntimeEnv.known_fields))}")
    if "env_vars" in environment:
        environment["env_vars"] = {str(key): value if isinstance(value, str) else str(value)
                                   for key, value in environment["env_vars"].items()}
    modules = list(environment.pop("py_modules", None) or [])
    for index, entry in enumerate(py_modules):
        try:
            path = resolve_py_module(entry)
        except ValueError as error:
            raise ValueError(f"py_modules[{index}]: {error}") from None
        if path not in modules:
            modules.append(path)
    if modules:
        environment["py_modules"] = modules
    try:
        RuntimeEnv(**environment)
    except (TypeError, ValueError) as error:
        raise ValueError(f"runtime_env: Ray refuses it: {error}") from None
    return environment


def plain(value: Any) -> Any:
    """Mappings and lists (OmegaConf nodes too) as dicts and lists, for Ray's validation."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(item) for item in value]
    return value


def resolve_py_module(entry: Any) -> str:
    """The local path (package folder or ``.py`` file) or URI Ray ships for one ``py_modules`` entry:
    an import name (a dotted one gives its top-level package), a module object, a path or a URI.

    Raises ``ValueError`` saying why when it cannot be found, is not Python source, or is ``__main__``.
    """
    if isinstance(entry, ModuleType):
        if entry.__name__ == "__main__":
            raise ValueError("the __main__ script needs no shipping: cloudpickle sends its classes and functions by value")
        top = sys.modules.get(entry.__name__.partition(".")[0], entry)
        location = getattr(top, "__path__", None) or [getattr(top, "__file__", None)]
        if len(location) != 1 or location[0] is None:
            raise ValueError(f"module {top.__name__!r} has no single file or folder to ship ({location})")
        return source_path(top.__name__, location[0])
    text = os.fspath(entry)
    if "://" in text:
        return text
    if isinstance(entry, os.PathLike) or "/" in text or os.sep in text or text.endswith(".py"):
        path = Path(text).expanduser().resolve()
        if path.is_dir() or (path.is_file() and path.suffix == ".py"):
            return str(path)
        raise ValueError(f"{text!r} is neither a folder nor a .py file (a path, because it has a '/' or ends in .py)")
    top = text.partition(".")[0]
    spec = importlib.util.find_spec(top) if top.isidentifier() else None
    if spec is None:
        raise ValueError(f"no module named {top!r} can be imported here (from sys.path), so it cannot be shipped; "
                         "check the name, or give the path of its file or folder")
    if spec.submodule_search_locations is not None:
        locations = list(spec.submodule_search_locations)
        if len(locations) != 1:
            raise ValueError(f"package {top!r} is spread over {locations}; give each folder as a path")
        return source_path(top, locations[0])
    return source_path(top, spec.origin)


def source_path(name: str, location: str | None) -> str:
    if location is not None and (Path(location).is_dir() or location.endswith(".py")):
        return str(Path(location).resolve())
    raise ValueError(f"module {name!r} is not Python source ({location}); install it on every machine instead "
                     "(runtime_env={'pip': [...]} or the cluster's image)")


def installation_roots() -> list[Path]:
    """Folders of the Python installation and virtual environment: their code is never the driver's own."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return [Path(root).resolve() for root in roots]


def driver_code_folder(main: ModuleType | None = None) -> Path | None:
    """The folder that ``sys.path[0]`` gives the driver: the ``__main__`` script's folder, the folder
    holding ``pkg`` for ``python -m pkg.module``, the current directory in a notebook or ``python -c``;
    None when it lies inside the Python installation or a virtual environment (``rlplat``, ``pytest``)."""
    main = main if main is not None else sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if file is None:
        folder = Path.cwd().resolve()
    else:
        folder = Path(file).resolve().parent
        spec = getattr(main, "__spec__", None)
        for _ in range(spec.name.count(".") if spec is not None and spec.name else 0):
            folder = folder.parent
    return None if any(folder.is_relative_to(root) for root in installation_roots()) else folder


def driver_modules(folder: Path | None = None, modules: Mapping[str, ModuleType] | None = None) -> list[str]:
    """The driver's own code that :func:`start_ray` ships by default: local paths of the top-level
    modules and packages already imported (``modules``, default ``sys.modules``) that live directly in
    ``folder`` (default :func:`driver_code_folder`) as ``folder/name.py`` or ``folder/name/``.

    The rule keeps the default safe: only code the driver imported from its own folder (what Ray
    already makes importable on the driver's machine), never ``__main__`` itself (cloudpickle sends it
    by value), a module an installed distribution provides (the environment's job on every machine),
    anything inside the Python installation or a virtual environment, or a package larger than
    :data:`DRIVER_PACKAGE_MAX_BYTES` (left out with a warning; name it in ``py_modules`` to ship it).
    A module imported only after Ray started is not shipped.
    """
    folder = driver_code_folder() if folder is None else folder.resolve()
    if folder is None:
        return []
    installed: Mapping[str, Any] | None = None
    roots = installation_roots()
    paths = []
    for name, module in sorted((modules if modules is not None else sys.modules).items()):
        file = getattr(module, "__file__", None)
        if "." in name or name == "__main__" or file is None:
            continue
        location = Path(file).resolve()
        if location == folder / f"{name}.py":
            path = location
        elif location == folder / name / "__init__.py":
            path = location.parent
        else:
            continue
        if installed is None:
            installed = importlib.metadata.packages_distributions()
        if name in installed or any(path.is_relative_to(root) for root in roots):
            continue
        if path.is_dir() and folder_bytes(path, DRIVER_PACKAGE_MAX_BYTES) > DRIVER_PACKAGE_MAX_BYTES:
            warnings.warn(f"start_ray: package {name!r} ({path}) is over {DRIVER_PACKAGE_MAX_BYTES >> 20} MiB and is not "
                          "shipped to the workers by default; name it in py_modules (cluster.py_modules) to ship it",
                          stacklevel=2)
            continue
        paths.append(str(path))
    return paths


def folder_bytes(path: Path, limit: int) -> int:
    """Bytes of the files under ``path`` (``__pycache__`` and ``.git`` aside), counted up to past ``limit``."""
    total = 0
    for root, folders, files in os.walk(path):
        folders[:] = [name for name in folders if name not in ("__pycache__", ".git")]
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue
        if total > limit:
            break
    return total


class ResourcePool:
    """Where a worker group's processes go: ``process_on_nodes[i]`` processes on node ``i``.

    Each process gets a bundle of ``cpus_per_process`` CPUs (and one GPU with ``use_gpu``) and runs
    ``threads_per_process`` torch threads (None: its share of its machine's cores, ``cores //
    processes of the pool on that machine``; Ray's CPU bundle only reserves, it does not size threads). Worker
    groups built on the same pool share its bundles; with ``max_colocate_count=k`` up to ``k`` groups'
    processes share one bundle, each taking ``1/k`` of its CPUs and GPU (fractional sharing).
    """

    def __init__(self, process_on_nodes: Sequence[int], use_gpu: bool = False, max_colocate_count: int = 1,
                 cpus_per_process: float = 1.0, name_prefix: str = "rlplat", threads_per_process: int | None = None):
        if not process_on_nodes or any(count < 1 for count in process_on_nodes):
            raise ValueError(f"process_on_nodes needs one positive count per node, got {list(process_on_nodes)}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.cpus_per_process = cpus_per_process
        self.threads_per_process = threads_per_process
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
    """The host actors (one process per bundle) that colocated Ray groups share."""

    def __init__(self, hosts: list[Any]):
        self.hosts = hosts
        self.alive = True

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
                    first, newline, rest = f"{type(cause).__name__}: {cause}".partition("\n")
                    if "No module named" in first:
                        first += (" (a module of yours that is not installed on the workers: ship it with "
                                  "start_ray(py_modules=[...]) or cluster.py_modules)")
                    message = first + newline + rest
                    raise WorkerError(role, calls[index].rank, method, message,
                                      getattr(error, "traceback_str", "") or str(error)) from error
                except ray.exceptions.RayActorError as error:
                    raise WorkerError(role, calls[index].rank, method,
                                      f"the worker process died ({type(error).__name__}): {error}") from error
        return values

    def ready(self, refs: list) -> bool:
        """Whether all of ``refs`` are ready now (values or errors), without waiting."""
        if not refs:
            return True
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def dispatch_infos(self, role: str) -> list[tuple[int, int, bool]]:
        refs = [host.dispatch_info.remote(role) for host in self.hosts]
        return self.wait(refs, [RankCall(rank, (), {}) for rank in range(len(self.hosts))], f"{role}.dispatch_info")

    def pids(self) -> list[int]:
        return ray.get([host.pid.remote() for host in self.hosts])

    def host_calls(self, method: str, *args: Any) -> list[Any]:
        """``WorkerHost.method(*args)`` in every process of this backend, in rank order."""
        calls = [RankCall(rank, (), {}) for rank in range(len(self.hosts))]
        return self.wait([getattr(host, method).remote(*args) for host in self.hosts], calls, f"host.{method}")

    def shutdown(self) -> None:
        if not self.alive:
            return
        self.alive = False
        try:
            ray.wait([host.shutdown.remote() for host in self.hosts], num_returns=len(self.hosts), timeout=10)
        finally:
            for host in self.hosts:
                ray.kill(host)


def start_hosts(pool: ResourcePool, init_distributed: bool = True, concurrent_calls: int = 1) -> RayBackend:
    """One host actor per bundle of ``pool``, with ``torch.distributed`` set up across them; each runs up to
    ``concurrent_calls`` calls at once, on threads of its own (1: one at a time, in order)."""
    slots = pool.slots()
    share = 1.0 / pool.max_colocate_count
    host_class = ray.remote(WorkerHost)
    on_node = collections.Counter(address for _, _, address, _ in slots)
    hosts = [
        host_class.options(
            num_cpus=pool.cpus_per_process * share,
            num_gpus=share if pool.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle),
            max_concurrency=max(1, int(concurrent_calls)),
        ).remote(rank, len(slots), local_rank, ray.get, processes_on_node=on_node[address], threads=pool.threads_per_process)
        for rank, (group, bundle, address, local_rank) in enumerate(slots)
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
                 init_distributed: bool = True, concurrent_calls: int = 1, _backend: RayBackend | None = None):
        spec = spec if isinstance(spec, WorkerSpec) else WorkerSpec(spec)
        backend = _backend or start_hosts(pool, init_distributed, concurrent_calls)
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

    def submit(self, method: str, calls: list[RankCall], data_parallel: bool) -> tuple[list, list]:
        results, pads = [], []
        for call in calls:
            remote = self.backend.hosts[call.rank].call
            if data_parallel:
                output, pad = remote.options(num_returns=2).remote(self.role, method, call.args, call.kwargs, call.pad_rows)
                pads.append(pad)
            else:
                output = remote.remote(self.role, method, call.args, call.kwargs, None)
            results.append(output)
        return results, pads

    def pids(self) -> list[int]:
        """Process id of each rank's worker."""
        return self.backend.pids()
