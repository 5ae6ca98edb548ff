"""Real wheels (``make dist``): one wheel per distribution of the checkout (core and every folder under
plugins/ with a pyproject.toml), holding every file of its packages' folders (package data included),
byte-identical when built again. Installed from those wheels into a fresh venv (third-party dependencies
from the registry), with no checkout on the path, core and a few plugins train two demo steps and
``rlplat plugins list`` shows their plugins and nothing else.

The wheels are built here, into a temporary folder, by the script ``make dist`` runs, so the test sees the
working tree as it is. The fresh venv is ~1.8 GB (torch, Ray and transformers unpacked, ~40 s on 2 cores)
and is removed when the module ends.
"""

from __future__ import annotations

import configparser
import email.parser
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path, PurePosixPath
from typing import Iterator

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The distributions the fresh venv gets (with the rlplat distributions they require): the demo's preset runs on
# the engine, rollout, algorithm and rule-reward plugins.
INSTALLED = ["rlplat", "rlplat-engine-fsdp2", "rlplat-rollout-hf", "rlplat-algorithms", "rlplat-rewards", "rlplat-demo"]

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_wheels.py"
# Core registers its own entries under its own name, without an entry point (rlplat.registry).
CORE_PLUGIN = ("rlplat", "rlplat")  # (plugin, distribution)


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_wheels", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def project_folders() -> list[Path]:
    """Core and the plugin folders the Makefile's PLUGIN_DIRS finds (a pyproject.toml 2 or 3 levels down)."""
    plugins = sorted({*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("plugins/*/*/pyproject.toml")})
    return [ROOT, *(pyproject.parent for pyproject in plugins)]


def build_wheels(out: Path) -> dict[str, Path]:
    """``make dist``'s build into ``out``: canonical distribution name -> wheel."""
    build = subprocess.run([sys.executable, str(BUILD_SCRIPT), str(out), *map(str, project_folders())],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    return {canonicalize_name(wheel.name.split("-")[0]): wheel for wheel in sorted(out.glob("*.whl"))}


def wheel_metadata(wheel: Path, file: str) -> str:
    """The text of ``file`` in the wheel's .dist-info folder ("" where there is none)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if name.endswith(f".dist-info/{file}")]
        return archive.read(names[0]).decode() if names else ""


def rlplat_requirements(wheel: Path) -> list[str]:
    """The rlplat distributions ``wheel`` requires (Requires-Dist without an extra)."""
    requirements = map(Requirement, email.parser.Parser().parsestr(wheel_metadata(wheel, "METADATA")).get_all("Requires-Dist") or [])
    return [canonicalize_name(requirement.name) for requirement in requirements
            if requirement.name.startswith("rlplat") and (requirement.marker is None or requirement.marker.evaluate({"extra": ""}))]


def with_rlplat_requirements(names: list[str], wheels: dict[str, Path]) -> list[str]:
    """``names`` and every rlplat distribution they require, directly or not; each must have a wheel."""
    needed, pending = set(), [canonicalize_name(name) for name in names]
    while pending:
        name = pending.pop()
        if name not in needed:
            assert name in wheels, f"{name} is required but has no wheel among {sorted(wheels)}"
            needed.add(name)
            pending += rlplat_requirements(wheels[name])
    return sorted(needed)


def venv_environment(venv: Path) -> dict[str, str]:
    """This process's environment as a user of ``venv`` would have it: its bin/ first, nothing of the
    checkout (no PYTHONPATH) and no plugin selection."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in {"PYTHONPATH", "PYTHONHOME", "RLPLAT_PLUGINS", "RLPLAT_DISABLE_PLUGIN_AUTOLOAD"}}
    environment["PATH"] = os.pathsep.join([str(venv / "bin"), environment.get("PATH", "")])
    environment["VIRTUAL_ENV"] = str(venv)
    return environment


def test_a_file_of_a_package_folder_missing_from_its_wheel_is_named_with_where_it_belongs(tmp_path):
    build_script = load_build_script()
    wheel = tmp_path / "demo-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("rlplat/__init__.py", "rlplat/demo/__init__.py", "rlplat/demo/assets/model/config.json",
                     "rlplat/cli/__init__.py"):
            archive.writestr(name, "")
    tree = [PurePosixPath(name) for name in (
        "README.md", "core/rlplat/__init__.py", "core/rlplat/demo/__init__.py", "core/rlplat/demo/assets/model/config.json",
        "core/rlplat/demo/assets/model/model.safetensors", "core/rlplat/demo/__pycache__/x.pyc", "core/rlplat/cli/__init__.py",
        "core/rlplat/cli/run.py", "tests/test_x.py")]
    missing = build_script.files_missing_from_wheel(wheel, PurePosixPath("."), tree, {"": "core"})
    assert missing == ["core/rlplat/demo/assets/model/model.safetensors (expected as rlplat/demo/assets/model/model.safetensors)",
                       "core/rlplat/cli/run.py (expected as rlplat/cli/run.py)"]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    return build_wheels(tmp_path_factory.mktemp("dist"))


@pytest.mark.slow
def test_every_distribution_of_the_checkout_has_one_wheel_of_its_version(wheels):
    projects = {}
    for folder in project_folders():
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        projects[canonicalize_name(project["name"])] = project["version"]
    assert {name: wheel.name.split("-")[1] for name, wheel in wheels.items()} == projects


@pytest.mark.slow
def test_a_rebuild_gives_byte_identical_wheels(wheels, tmp_path):
    rebuilt = build_wheels(tmp_path / "again")
    assert {name: wheel.read_bytes() for name, wheel in rebuilt.items()} == {
        name: wheel.read_bytes() for name, wheel in wheels.items()}


@pytest.fixture(scope="module")
def fresh_venv(wheels, tmp_path_factory) -> Iterator[tuple[Path, Path, list[str]]]:
    """``(venv, a working folder outside the checkout, the rlplat distributions installed)``.

    The rlplat distributions come from the wheel files alone (``--no-index --no-deps``); a second pip
    then brings their third-party requirements from the registry (torch named, constraints.txt), which
    leaves the already installed rlplat distributions alone, and its report is checked for that."""
    folder = tmp_path_factory.mktemp("wheels-venv")
    venv, work = folder / "venv", folder / "work"
    work.mkdir()
    distributions = with_rlplat_requirements(INSTALLED, wheels)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        # This venv's pip installs into the new one (--python): no pip of its own to install first.
        pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet"]
        environment = venv_environment(venv)
        from_wheels = subprocess.run([*pip, "--no-index", "--no-deps", *(str(wheels[name]) for name in distributions)],
                                     capture_output=True, text=True, timeout=300, env=environment, cwd=work)
        assert from_wheels.returncode == 0, from_wheels.stderr
        report = folder / "pip-report.json"
        requirements = subprocess.run(
            [*pip, "--report", str(report), "-c", str(ROOT / "constraints.txt"), "torch==2.13.0", *distributions],
            capture_output=True, text=True, timeout=900, env=environment, cwd=work)
        assert requirements.returncode == 0, requirements.stderr[-5000:]
        from_registry = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
        assert [name for name in from_registry if canonicalize_name(name).startswith("rlplat")] == []
        yield venv, work, distributions
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_the_venv_imports_rlplat_and_its_plugins_from_the_installed_wheels_only(fresh_venv, wheels):
    venv, work, distributions = fresh_venv
    probe = textwrap.dedent("""
        import importlib.metadata, json, sys
        import rlplat
        found = {}
        for dist in importlib.metadata.distributions():
            if dist.metadata["Name"].startswith("rlplat"):
                found[dist.metadata["Name"]] = [dist.version, str(dist.locate_file(""))]
        print(json.dumps({"rlplat": rlplat.__file__, "path": sys.path, "distributions": found}))
    """)
    result = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                            timeout=120, env=venv_environment(venv), cwd=work)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    site_packages = next((venv / "lib").glob("python3*/site-packages")).resolve()
    assert Path(seen["rlplat"]).resolve().is_relative_to(site_packages)
    assert [entry for entry in seen["path"] if entry and Path(entry).resolve().is_relative_to(ROOT)] == []
    assert {canonicalize_name(name): version for name, (version, _) in seen["distributions"].items()} == {
        name: wheels[name].name.split("-")[1] for name in distributions}
    assert {Path(location).resolve() for _, location in seen["distributions"].values()} == {site_packages}


@pytest.mark.slow
def test_plugins_list_shows_exactly_the_plugins_of_the_installed_distributions(fresh_venv, wheels):
    venv, work, distributions = fresh_venv
    expected = [CORE_PLUGIN]
    for name in distributions:
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.optionxform = str
        entry_points.read_string(wheel_metadata(wheels[name], "entry_points.txt"))
        if entry_points.has_section("rlplat"):
            project = email.parser.Parser().parsestr(wheel_metadata(wheels[name], "METADATA"))["Name"]
            expected += [(plugin, project) for plugin in entry_points["rlplat"]]
    listing = subprocess.run([str(venv / "bin" / "rlplat"), "plugins", "list", "--json"], capture_output=True,
                             text=True, timeout=120, env=venv_environment(venv), cwd=work)
    assert listing.returncode == 0, listing.stderr
    plugins = json.loads(listing.stdout)
    assert sorted((plugin["plugin"], plugin["distribution"]) for plugin in plugins) == sorted(expected)
    assert [(plugin["plugin"], plugin["reason"]) for plugin in plugins if plugin["status"] != "ok"] == []


@pytest.mark.slow
def test_two_demo_steps_train_from_the_installed_wheels(fresh_venv):
    venv, work, _ = fresh_venv
    run_dir = work / "demo-run"
    result = subprocess.run(
        [str(venv / "bin" / "rlplat"), "run", "trainer.total_training_steps=2", "trainer.test_freq=0",
         "trainer.val_before_train=false", f"trainer.output_dir={run_dir}", "trainer.resume=disable"],
        capture_output=True, text=True, timeout=600, env=venv_environment(venv), cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training the built-in demo (grpo, preset arith)" in result.stderr
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    # The demo's tiny model is the one the wheel installed.
    model = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"])
    assert model.is_relative_to(venv) and (model / "config.json").exists()
