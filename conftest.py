"""Settings and fixtures for the whole test run: ``tests/`` and every built-in plugin's ``tests/``
(subprocess runs of this venv's interpreter and ``rlplat`` script in the repository's root, a local Ray
cluster). ``cli_in_process`` and the helpers behind the subprocess runs are rlplat.testing's
(:mod:`rlplat.testing.cli`)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlplat.testing import cli as testing_cli

ROOT = Path(__file__).resolve().parent


def pytest_configure(config) -> None:
    # torch caps OMP_NUM_THREADS at the machine's cores (OMP_NUM_THREADS=4 gives 2 threads on 2 cores), so
    # `make test-matrix` sets the test process's threads with this to run as a machine with more cores does.
    threads = os.environ.get("RLPLAT_TEST_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


@pytest.fixture
def python_run():
    """``python_run(code, pythonpath=None, env=None, timeout=120)``: run code in a fresh interpreter of this
    venv, in the repository's root."""
    return functools.partial(testing_cli.run_python, cwd=ROOT)


@pytest.fixture
def cli_run():
    """``cli_run(*args, pythonpath=None, env=None, timeout=120)``: run the installed ``rlplat`` console script
    in the repository's root (rlplat.testing's ``cli_run``, which this one overrides, runs it in ``tmp_path``)."""
    return functools.partial(testing_cli.run_cli, cwd=ROOT)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster for one test module (dashboard off, 127.0.0.1, token auth off), then stopped."""
    import ray

    from rlplat.controller.ray_backend import start_ray

    if ray.is_initialized():
        ray.shutdown()
    start_ray(num_cpus=8)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_by_the_module():
    """A run on ``cluster.backend=ray`` starts a local Ray cluster in this process and leaves it up for the
    next run of the module; it is stopped when the module ends, so that no module leaves Ray's processes
    running into the next (whose idle load they would add to)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


class PluginInstaller:
    """Installs a plugin folder as a user's plugin is installed, but into a folder of its own
    (``pip install --no-deps --target``) that only the subprocesses given it on PYTHONPATH see; nothing is
    installed into this venv."""

    @staticmethod
    def pip(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)

    @staticmethod
    def processes_with_in_environment(marker: str) -> list[int]:
        """Ids of this user's processes whose environment mentions ``marker`` (empty where /proc is absent)."""
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if marker.encode() in (entry / "environ").read_bytes() and int(entry.name) != os.getpid():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def install(self, plugin: Path, folder: Path, distribution: str, package: str) -> Path:
        """``plugin`` copied to ``folder/source`` and installed into ``folder/site`` (returned); the copy's
        package is removed afterwards, so whatever imports it imports the installed one. Its tests stay in
        ``folder/source/tests``."""
        assert self.pip("show", distribution).returncode != 0, (
            f"{distribution} is installed in this venv; `pip uninstall {distribution}` first")
        source, site = folder / "source", folder / "site"
        shutil.copytree(plugin, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        result = self.pip("install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site), str(source))
        assert result.returncode == 0, result.stderr
        shutil.rmtree(source / package)
        return site

    def stop_processes_of(self, site: Path) -> None:
        """Stop the processes a failed run left behind (every process it started has ``site`` in its PYTHONPATH)."""
        for pid in self.processes_with_in_environment(str(site)):
            os.kill(pid, signal.SIGKILL)

    def run_own_tests(self, site: Path) -> subprocess.CompletedProcess:
        """The installed plugin's own tests (``site/../source/tests``) in a pytest subprocess that sees it."""
        tests = site.parent / "source" / "tests"
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tests)],
            capture_output=True, text=True, timeout=300, cwd=site, env=testing_cli.subprocess_environment(site),
        )


@pytest.fixture(scope="session")
def plugin_installer() -> PluginInstaller:
    """Installs a plugin folder into a folder of its own (:class:`PluginInstaller`)."""
    return PluginInstaller()
