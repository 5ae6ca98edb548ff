"""Fixtures of this plugin's tests: the ``rlplat`` command run as a user runs it (the installed script, in
a fresh process) and in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def cli_run(tmp_path):
    """``cli_run(*args, env=None, timeout=120)``: the installed ``rlplat`` console script, run in
    ``tmp_path`` with the user's plugin switches cleared."""
    script = VENV_BIN / "rlplat"
    assert script.exists(), f"{script} is missing: install rlplat and this plugin into this venv first (make setup)"

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        environment = {key: value for key, value in os.environ.items()
                       if key not in ("RLPLAT_PLUGINS", "RLPLAT_DISABLE_PLUGIN_AUTOLOAD")}
        environment.update(env or {})
        return subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, env=environment,
                              timeout=timeout, cwd=tmp_path)

    return run


@pytest.fixture
def cli_in_process(capfd):
    """``cli_in_process(*args)``: ``rlplat <args>`` run by ``rlplat.cli.main.main`` in this process; a
    CompletedProcess with its exit code and what it wrote to stdout and stderr."""
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
