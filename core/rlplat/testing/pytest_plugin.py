"""pytest fixtures offered to every repository that installs rlplat (entry point ``pytest11``)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from rlplat.plugins import ENV_DISABLE_AUTOLOAD
from rlplat.registry import Registry

# Plugin authors check that a conformance suite catches a broken implementation with pytester.
pytest_plugins = ["pytester"]


@pytest.fixture
def isolated_registry() -> Registry:
    """A new, empty registry (no entry point, not even rlplat's own entries); fill it with
    ``register_plugin``."""
    return Registry(environ={ENV_DISABLE_AUTOLOAD: "1"}, include_builtins=False)


@pytest.fixture
def register_temporary_plugin() -> Iterator[Callable[..., Any]]:
    """``register_temporary_plugin(plugin, name=None)`` registers a plugin object or module in the
    process-wide registry for the duration of one test and returns its record."""
    from rlplat import registry

    registered: list[str] = []

    def register(plugin: Any, name: str | None = None, **kwargs: Any):
        record = registry.register_plugin(plugin, name=name, **kwargs)
        registered.append(record.name)
        return record

    yield register
    for name in reversed(registered):
        registry.unregister_plugin(name)


@pytest.fixture
def cli_run(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """``cli_run(*args, pythonpath=None, env=None, timeout=120)``: the installed ``rlplat`` console script,
    run in ``tmp_path`` with the user's plugin switches cleared (:func:`rlplat.testing.cli.run_cli`)."""
    from rlplat.testing.cli import run_cli

    return functools.partial(run_cli, cwd=tmp_path)


@pytest.fixture
def cli_in_process(capfd: Any) -> Callable[..., subprocess.CompletedProcess]:
    """``cli_in_process(*args)``: ``rlplat <args>`` run by ``rlplat.cli.main.main`` in this process; a
    CompletedProcess with its exit code and what it wrote to stdout and stderr
    (:func:`rlplat.testing.cli.in_process`)."""
    from rlplat.testing.cli import in_process

    return in_process(capfd)


@pytest.fixture
def scripted_policy() -> type:
    """``scripted_policy(replies)``: a :class:`rlplat.testing.agents.ScriptedPolicy` (an OpenAI-compatible
    chat endpoint answering with ``replies``) to serve in an ``async with`` block."""
    from rlplat.testing.agents import ScriptedPolicy

    return ScriptedPolicy
