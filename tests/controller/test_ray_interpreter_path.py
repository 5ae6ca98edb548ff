"""Ray's workers start wherever the interpreter lies: a runtime environment makes Ray start each worker
through ``bash -c "exec <interpreter> ..."`` with the path unquoted, which a clone or venv under a folder
whose name has a space (``~/my projects``) broke; ``start_ray`` hands Ray the quoted path."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from rlplat.controller.ray_backend import quoted_interpreter


def test_a_path_that_needs_quoting_is_given_quoted(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/home/me/my projects/rlplat/.venv/bin/python")
    runtime = {"runtime_env": {"env_vars": {"A": "1"}}}
    assert quoted_interpreter(runtime) == {"runtime_env": {
        "env_vars": {"A": "1"}, "py_executable": "'/home/me/my projects/rlplat/.venv/bin/python'"}}
    assert runtime == {"runtime_env": {"env_vars": {"A": "1"}}}  # the caller's dict is left alone


@pytest.mark.parametrize("runtime", [{}, {"runtime_env": {"pip": ["six"]}}, {"runtime_env": {"py_executable": "uv run"}},
                                     {"runtime_env": {"conda": "env"}}])
def test_no_runtime_env_or_one_that_chooses_the_interpreter_is_left_as_it_is(monkeypatch, runtime):
    monkeypatch.setattr(sys, "executable", "/home/me/my projects/python")
    assert quoted_interpreter(runtime) == runtime


def test_a_plain_path_needs_nothing(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    assert quoted_interpreter({"runtime_env": {"env_vars": {"A": "1"}}}) == {"runtime_env": {"env_vars": {"A": "1"}}}


@pytest.mark.slow
def test_workers_start_with_a_runtime_env_from_an_interpreter_under_a_folder_with_a_space(tmp_path):
    # this test environment seen through a folder whose name has a space (a venv finds itself from the
    # path it is started by, so sys.executable has the space)
    environment = tmp_path / "my projects" / "venv"
    environment.parent.mkdir()
    environment.symlink_to(sys.prefix, target_is_directory=True)
    python = environment / "bin" / "python"
    code = textwrap.dedent("""
        import os, ray
        from rlplat.controller.ray_backend import start_ray
        assert " " in __import__("sys").executable
        start_ray(num_cpus=1, runtime_env={"env_vars": {"RLPLAT_PROBE": "reached"}})
        try:
            print("WORKER", ray.get(ray.remote(lambda: os.environ.get("RLPLAT_PROBE")).remote(), timeout=120))
        finally:
            ray.shutdown()
    """)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0 and "WORKER reached" in result.stdout, (shlex.quote(str(python)), result.stderr[-3000:])
