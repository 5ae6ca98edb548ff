"""The core's budget, counted from source: core (``core/rlplat/`` without the test kit ``rlplat.testing`` and the
command line ``rlplat.cli``, whose commands only the ``rlplat`` shell runs) stays within 15,000 lines, its kernel
within 6,000, and a module of the kits (``rlplat.kits``, ``rlplat.losses``) is there for a reason the source
shows: at least two plugin distributions import it, or a contract's default is built from it, or the allow-list
below says why. Each failure names the module."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "core" / "rlplat"

CORE_BUDGET = 15_000
KERNEL_BUDGET = 6_000

#: Left out of core's count: the test kit, and the command line (doctor, config explain, the planner: what only
#: the `rlplat` commands run).
OUTSIDE_CORE = ("testing", "cli")

#: The kernel: DataProto, the single controller, the contracts, the registry and its hooks, plugin loading, the
#: config reader and the plugin API's versions and deprecations.
KERNEL = ("protocol/", "controller/", "contracts/", "registry.py", "hookspecs.py", "plugins.py", "config_node.py",
          "api_version.py", "deprecation.py", "lazy_names.py", "__init__.py")

KIT_FOLDERS = ("kits", "losses")

#: Kit modules with fewer than two plugin importers, and why each stays in core.
ALLOWED = {
    "kits.advantages": "the grouping and shape checks every advantage estimator needs: public for third-party "
                       "estimators since plugin API 1.2 (docs/plugin_api.md; the plugin template's estimator uses it)",
    "kits.agent": "what every agent loop builds its trajectory with: public for third-party agent loops (it was part "
                  "of the agent contract until plugin API 1.3)",
    "kits.weights": "the weight sync of the built-in actor worker (buckets) and the fingerprints "
                    "RolloutEngine.weight_fingerprints returns",
}


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def core_files(package: Path = PACKAGE) -> list[Path]:
    return [path for path in package.rglob("*.py")
            if path.relative_to(package).parts[0] not in OUTSIDE_CORE and "__pycache__" not in path.parts]


def is_kernel(path: Path, package: Path = PACKAGE) -> bool:
    relative = path.relative_to(package).as_posix()
    return any(relative.startswith(part) if part.endswith("/") else relative == part for part in KERNEL)


def plugin_packages() -> dict[str, Path]:
    """Each plugin distribution's package (those with an ``rlplat`` entry point) -> its folder."""
    found = {}
    for pyproject in ROOT.glob("plugins/**/pyproject.toml"):
        if "tests" in pyproject.parts:
            continue
        config = tomllib.loads(pyproject.read_text())
        if "rlplat" not in config.get("project", {}).get("entry-points", {}):
            continue
        for name in config.get("tool", {}).get("setuptools", {}).get("packages", []):
            found.setdefault(name.split(".")[0], pyproject.parent / name.split(".")[0])
    return found


def lazy_names(init: Path) -> dict[str, str]:
    """A package's ``_LAZY_NAMES`` (public name -> module) as its ``__init__.py`` writes them (plain entries)."""
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(init.read_text())):
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if getattr(target, "id", None) == "_LAZY_NAMES" and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    names[key.value] = value.value
    return names


def imported_modules(tree: ast.AST, package: Path = PACKAGE) -> set[str]:
    """The kit modules (``folder.module``) a source file imports: by module path, as a submodule, or as a
    public name of the folder's package."""
    found = set()
    for folder in KIT_FOLDERS:
        modules = {path.stem for path in (package / folder).glob("*.py")} - {"__init__"}
        public = lazy_names(package / folder / "__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.startswith(f"rlplat.{folder}."):
                    found.add(f"{folder}.{node.module.split('.')[2]}")
                elif node.module == f"rlplat.{folder}":
                    for alias in node.names:
                        if alias.name in modules:
                            found.add(f"{folder}.{alias.name}")
                        elif alias.name in public:
                            found.add(f"{folder}.{public[alias.name].split('.')[2]}")
            elif isinstance(node, ast.Import):
                found.update(f"{folder}.{alias.name.split('.')[2]}" for alias in node.names
                             if alias.name.startswith(f"rlplat.{folder}."))
    return found


def plugin_importers(package: Path = PACKAGE, plugins: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Kit module -> the plugin packages whose own code (not their tests) imports it."""
    importers: dict[str, set[str]] = {}
    for name, folder in (plugin_packages() if plugins is None else plugins).items():
        for path in folder.rglob("*.py"):
            for module in imported_modules(ast.parse(path.read_text()), package):
                importers.setdefault(module, set()).add(name)
    return importers


def contract_defaults(package: Path = PACKAGE) -> set[str]:
    """Kit modules a contract's default is built from: those a contract names as a default
    (``actor_loss = "rlplat.losses:ActorLoss"``), and the kit modules those import in turn."""
    defaults = set()
    for path in (package / "contracts").glob("*.py"):
        classes = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]
        values = [item.value for cls in classes for item in cls.body if isinstance(item, (ast.Assign, ast.AnnAssign))]
        for node in values:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
                module, _, attribute = node.value.partition(":")
                parts = module.split(".")
                if len(parts) >= 2 and parts[0] == "rlplat" and parts[1] in KIT_FOLDERS and attribute.isidentifier():
                    if len(parts) == 3:
                        defaults.add(f"{parts[1]}.{parts[2]}")
                    elif attribute in (public := lazy_names(package / parts[1] / "__init__.py")):
                        defaults.add(f"{parts[1]}.{public[attribute].split('.')[2]}")
    pending = list(defaults)
    while pending:
        folder, module = pending.pop().split(".")
        for found in imported_modules(ast.parse((package / folder / f"{module}.py").read_text()), package):
            if found not in defaults:
                defaults.add(found)
                pending.append(found)
    return defaults


def kit_rule_offenders(package: Path = PACKAGE, plugins: dict[str, Path] | None = None) -> list[str]:
    importers, defaults = plugin_importers(package, plugins), contract_defaults(package)
    offenders = []
    for folder in KIT_FOLDERS:
        for path in sorted((package / folder).glob("*.py")):
            module = f"{folder}.{path.stem}"
            users = importers.get(module, set())
            if path.stem == "__init__" or len(users) >= 2 or module in defaults or module in ALLOWED:
                continue
            offenders.append(f"rlplat.{module} ({path.relative_to(package.parent)}): {len(users)} plugin importer(s) "
                             f"({', '.join(sorted(users)) or 'none'}), no contract's default, not on the allow-list: "
                             "move it into its plugin, or say in ALLOWED why it stays")
    return offenders


def test_core_stays_within_its_line_budget():
    counts = {path: line_count(path) for path in core_files()}
    total = sum(counts.values())
    largest = ", ".join(f"{path.relative_to(PACKAGE)} {lines}" for path, lines in sorted(counts.items(), key=lambda item: -item[1])[:5])
    assert total <= CORE_BUDGET, f"core is {total} lines, over its budget of {CORE_BUDGET} (largest: {largest})"


def test_the_kernel_stays_within_its_line_budget():
    counts = {path: line_count(path) for path in core_files() if is_kernel(path)}
    total = sum(counts.values())
    assert len(counts) > 20, "the kernel's modules were not found"
    largest = ", ".join(f"{path.relative_to(PACKAGE)} {lines}" for path, lines in sorted(counts.items(), key=lambda item: -item[1])[:5])
    assert total <= KERNEL_BUDGET, f"the kernel is {total} lines, over its budget of {KERNEL_BUDGET} (largest: {largest})"


def test_every_kit_module_has_two_plugin_importers_or_a_reason():
    assert kit_rule_offenders() == []


def test_the_allow_list_names_only_kit_modules_that_need_it():
    importers, defaults = plugin_importers(), contract_defaults()
    for module in ALLOWED:
        folder, name = module.split(".")
        assert (PACKAGE / folder / f"{name}.py").is_file(), f"ALLOWED names rlplat.{module}, which does not exist"
        assert len(importers.get(module, ())) < 2 and module not in defaults, f"rlplat.{module} needs no allow-list entry"


def test_the_contract_defaults_are_found():
    assert {"losses.functions", "losses.kl", "losses.value", "losses.aggregation", "losses.config",
            "losses.rollout_correction"} <= contract_defaults()


def test_a_kit_module_with_one_plugin_importer_fails_the_rule_by_name(tmp_path):
    """A copy of core's kits and contracts with a module more in ``kits/`` that one plugin imports fails, named;
    a second importer makes it a kit."""
    import shutil

    copy = tmp_path / "rlplat"
    for folder in (*KIT_FOLDERS, "contracts"):
        shutil.copytree(PACKAGE / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "kits" / "one_user.py").write_text('"""A helper only one plugin uses."""\n\n\ndef helper():\n    return 1\n')
    plugins = dict(plugin_packages())
    for name in ("rlplat_first_user", "rlplat_second_user"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("from rlplat.kits.one_user import helper\n")
    offenders = kit_rule_offenders(copy, {**plugins, "rlplat_first_user": tmp_path / "rlplat_first_user"})
    assert len(offenders) == 1, offenders
    assert offenders[0].startswith("rlplat.kits.one_user (rlplat/kits/one_user.py): 1 plugin importer(s) (rlplat_first_user)")
    assert kit_rule_offenders(copy, {**plugins, **{name: tmp_path / name for name in ("rlplat_first_user", "rlplat_second_user")}}) == []
