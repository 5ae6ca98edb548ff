"""The root distribution ships core/rlplat/ (the CLI at core/rlplat/cli/) with every subpackage."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_is_one_package_folder_and_every_python_folder_in_it_is_a_package():
    """Like every plugin, core keeps its package in a folder of its own (core/rlplat/, the CLI at core/rlplat/cli/);
    setuptools finds the subpackages, so a folder of Python files without ``__init__.py`` would be left out."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"": "core"}
    assert config["packages"]["find"] == {"where": ["core"], "include": ["rlplat*"]}
    assert sorted(path.name for path in (ROOT / "core").iterdir() if path.name != "__pycache__") == ["rlplat"]
    for folder in (ROOT / "core" / "rlplat").rglob("*"):
        if folder.is_dir() and "__pycache__" not in folder.parts and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder} holds Python files but no __init__.py"


def test_console_script_and_pytest_plugin_are_declared():
    entry_points = importlib.metadata.distribution("rlplat").entry_points
    scripts = {ep.name: ep.value for ep in entry_points if ep.group == "console_scripts"}
    pytest_plugins = {ep.name: ep.value for ep in entry_points if ep.group == "pytest11"}
    assert scripts == {"rlplat": "rlplat.cli.main:main"}
    assert pytest_plugins == {"rlplat": "rlplat.testing.pytest_plugin"}


def test_every_plugin_folder_is_a_distribution_with_readme_tests_and_an_rlplat_entry_point():
    found = [*(ROOT / "plugins").glob("*/pyproject.toml"), *(ROOT / "plugins").glob("*/*/pyproject.toml")]
    assert ROOT / "plugins" / "demo" / "pyproject.toml" in found  # a plugin of no kind sits one level up
    for pyproject in sorted(found):
        folder = pyproject.parent
        project = tomllib.loads(pyproject.read_text())["project"]
        assert (folder / "README.md").exists(), folder
        assert (folder / "tests").is_dir(), folder
        assert project["entry-points"]["rlplat"], folder
        assert any(dep.split("=")[0].split(">")[0].strip() == "rlplat" for dep in project["dependencies"]), folder
