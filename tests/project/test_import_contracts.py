"""The import contracts of ``.importlinter`` hold: core never imports a plugin, plugins import one another
only where declared, and core's layers import downwards only. Every plugin package of the repository is
named in the contracts."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def plugin_packages() -> set[str]:
    """The packages of the plugin distributions under ``plugins/`` (``[tool.setuptools] packages``): those that
    declare themselves in the ``rlplat`` entry-point group (not a backend's stand-in shipped beside a plugin, such
    as the sglang rollout's ``sgl_kernel`` for CPUs)."""
    import tomllib

    packages = set()
    for pyproject in ROOT.glob("plugins/**/pyproject.toml"):
        if "tests" in pyproject.parts:
            continue
        config = tomllib.loads(pyproject.read_text())
        if "rlplat" not in config.get("project", {}).get("entry-points", {}):
            continue
        packages.update(name.split(".")[0] for name in config.get("tool", {}).get("setuptools", {}).get("packages", []))
    return packages


def contracts() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    return parser


def names(value: str) -> set[str]:
    return {line.strip() for line in value.splitlines() if line.strip()}


def test_every_plugin_package_is_under_the_contracts():
    parser = contracts()
    expected = plugin_packages()
    assert expected, "no plugin packages found"
    assert names(parser["importlinter"]["root_packages"]) == expected | {"rlplat"}
    assert names(parser["importlinter:contract:core-imports-no-plugin"]["forbidden_modules"]) == expected
    assert names(parser["importlinter:contract:plugins-independent"]["modules"]) == expected


def test_the_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), str(ROOT / ".importlinter")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout


def test_the_command_line_is_cores_top_layer():
    """``rlplat.cli`` (core/rlplat/cli/) sits above every other layer of core, so the contracts read its imports too."""
    layers = [line.strip() for line in contracts()["importlinter:contract:core-layers"]["layers"].splitlines() if line.strip()]
    assert layers[0].split(" : ")[0] == "cli"


def test_type_checking_imports_count_in_the_contracts():
    """An annotation is an import too: a contract that names an upper layer's type only for type checking still
    depends on it (the memory-plan types and ``Fingerprint`` live in the contracts for that reason)."""
    assert contracts()["importlinter"]["exclude_type_checking_imports"].strip() == "False"
