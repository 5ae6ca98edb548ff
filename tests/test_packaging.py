"""The root distribution maps core/ to rlplat and cli/ to rlplat.cli and ships every subpackage."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_python_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"rlplat": "core", "rlplat.cli": "cli"}
    found = set()
    for top, folder in (("rlplat", ROOT / "core"), ("rlplat.cli", ROOT / "cli")):
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((top, *relative)))
    assert found == set(config["packages"])


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
