"""Where vllm is not installed (the main environment): the rollout is listed as unavailable with the
install hint, and a run that asks for it fails at config validation, before any worker starts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this environment")

HINT = "pip install 'rlplat-rollout-vllm[vllm]'"


def rlplat_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).with_name("rlplat")
    return subprocess.run([str(executable), *args], capture_output=True, text=True, cwd=cwd, timeout=120, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "300"})


def test_the_registry_reports_vllm_unavailable_with_the_install_hint():
    from rlplat.registry import Registry

    entry = Registry().entry("rollout", "vllm")
    assert entry.status.startswith("unavailable: vllm is not installed") and HINT in entry.status


def test_plugins_list_shows_the_hint(tmp_path):
    result = rlplat_cli("plugins", "list", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "unavailable: vllm is not installed" in result.stdout and HINT in result.stdout


@pytest.mark.slow
def test_run_with_the_vllm_rollout_fails_before_starting_anything(tmp_path):
    result = rlplat_cli("run", "--algo", "grpo", "--engine", "fsdp2", "--rollout", "vllm", f"trainer.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0
    assert "rollout.name: rollout 'vllm' is unavailable: vllm is not installed" in result.stderr
    assert HINT in result.stderr
    assert not (tmp_path / "run").exists()
