"""Settings and fixtures for the whole test run: ``tests/`` and every built-in plugin's ``tests/``
(subprocess runs of this venv's interpreter and ``rlplat`` script, the CLI in process, a local Ray cluster)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent


def pytest_configure(config) -> None:
    # torch caps OMP_NUM_THREADS at the machine's cores (OMP_NUM_THREADS=4 gives 2 threads on 2 cores), so
    # `make test-matrix` sets the test process's threads with this to run as a machine with more cores does.
    threads = os.environ.get("RLPLAT_TEST_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def subprocess_environment(pythonpath: Path | None, env: dict[str, str] | None) -> dict[str, str]:
    environment = dict(os.environ)
    environment.pop("RLPLAT_PLUGINS", None)
    environment.pop("RLPLAT_DISABLE_PLUGIN_AUTOLOAD", None)
    if pythonpath is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), environment.get("PYTHONPATH")]))
    environment.update(env or {})
    return environment


def run_python(code: str, *, pythonpath: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120):
    """Run ``code`` in a fresh interpreter of this venv; returns the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=subprocess_environment(pythonpath, env), timeout=timeout, cwd=ROOT,
    )


def run_cli(*args: str, pythonpath: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120):
    """Run the installed ``rlplat`` console script, as a user would."""
    script = VENV_BIN / "rlplat"
    assert script.exists(), f"{script} is missing: install rlplat into this venv first (make setup)"
    return subprocess.run(
        [str(script), *args],
        capture_output=True, text=True, env=subprocess_environment(pythonpath, env), timeout=timeout, cwd=ROOT,
    )


@pytest.fixture
def python_run():
    """``python_run(code, pythonpath=None, env=None)``: run code in a fresh interpreter of this venv."""
    return run_python


@pytest.fixture
def cli_run():
    """``cli_run(*args, pythonpath=None, env=None)``: run the installed ``rlplat`` console script."""
    return run_cli


@pytest.fixture
def cli_in_process(capfd):
    """``cli_in_process(*args)``: ``rlplat <args>`` run by ``rlplat.cli.main.main`` in this process (no new
    interpreter); returns a CompletedProcess with its exit code and what it wrote to stdout and stderr."""
    from rlplat.cli.main import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()  # what came before is not the command's output
        try:
            main([str(arg) for arg in args])
            code = 0
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["rlplat", *args], code, out, err)

    return run


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
            capture_output=True, text=True, timeout=300, cwd=site, env=subprocess_environment(site, None),
        )


@pytest.fixture(scope="session")
def plugin_installer() -> PluginInstaller:
    """Installs a plugin folder into a folder of its own (:class:`PluginInstaller`)."""
    return PluginInstaller()
