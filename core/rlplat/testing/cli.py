"""Running the ``rlplat`` command in tests: the installed console script in a fresh process, as a user
runs it (:func:`run_cli`), code in a fresh interpreter of this venv (:func:`run_python`), and the CLI in
this process (:func:`in_process`). The subprocesses run with the user's plugin switches cleared
(:data:`PLUGIN_SWITCHES`), so every installed plugin loads unless a test's ``env`` says otherwise.

The fixtures ``cli_run`` and ``cli_in_process`` of :mod:`rlplat.testing.pytest_plugin` offer them to any
repository that installs rlplat."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional

VENV_BIN = Path(sys.executable).parent
"""The folder of this interpreter and of the ``rlplat`` script installed beside it."""

PLUGIN_SWITCHES = ("RLPLAT_PLUGINS", "RLPLAT_DISABLE_PLUGIN_AUTOLOAD")
"""The environment variables that choose which plugins load, cleared in the subprocesses."""


def subprocess_environment(pythonpath: Optional[Path] = None, env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """This process's environment without :data:`PLUGIN_SWITCHES`, with ``pythonpath`` put first on
    ``PYTHONPATH`` and ``env`` on top."""
    environment = {key: value for key, value in os.environ.items() if key not in PLUGIN_SWITCHES}
    if pythonpath is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), environment.get("PYTHONPATH")]))
    environment.update(env or {})
    return environment


def run_python(code: str, *, cwd: Path, pythonpath: Optional[Path] = None, env: Optional[dict[str, str]] = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter of this venv in ``cwd``; the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=subprocess_environment(pythonpath, env), timeout=timeout, cwd=cwd,
    )


def run_cli(*args: Any, cwd: Path, pythonpath: Optional[Path] = None, env: Optional[dict[str, str]] = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the installed ``rlplat`` console script with ``args`` in ``cwd``, as a user would; the
    CompletedProcess (text)."""
    script = VENV_BIN / "rlplat"
    assert script.exists(), f"{script} is missing: install rlplat into this venv first (make setup)"
    return subprocess.run(
        [str(script), *map(str, args)],
        capture_output=True, text=True, env=subprocess_environment(pythonpath, env), timeout=timeout, cwd=cwd,
    )


def in_process(capfd: Any) -> Callable[..., subprocess.CompletedProcess]:
    """``run(*args)``: ``rlplat <args>`` run by ``rlplat.cli.main.main`` in this process (no new
    interpreter); a CompletedProcess with its exit code and what it wrote to stdout and stderr, read
    through pytest's ``capfd``."""
    from rlplat.cli.main import main

    def run(*args: Any) -> subprocess.CompletedProcess:
        capfd.readouterr()  # what came before is not the command's output
        try:
            main([str(arg) for arg in args])
            code = 0
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["rlplat", *args], code, out, err)

    return run
