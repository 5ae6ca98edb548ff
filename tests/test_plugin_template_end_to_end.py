"""Discovery end to end: pip-install the plugin template, see it, use it, run its own tests, uninstall."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "plugin-template"
DISTRIBUTION = "rlplat-plugin-template"


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def installed_template(tmp_path):
    if pip("show", DISTRIBUTION).returncode == 0:
        pytest.fail(f"{DISTRIBUTION} is already installed in this venv; `pip uninstall {DISTRIBUTION}` first")
    source = tmp_path / "plugin-template"
    shutil.copytree(TEMPLATE, source)  # building writes metadata beside the sources; keep the repo clean
    result = pip("install", "--quiet", "--no-deps", "--no-build-isolation", str(source))
    assert result.returncode == 0, result.stderr
    try:
        yield source
    finally:
        result = pip("uninstall", "--yes", DISTRIBUTION)
        assert result.returncode == 0, result.stderr


def test_installed_template_is_listed_usable_and_passes_its_conformance_tests(installed_template, cli_run, python_run):
    listing = cli_run("plugins", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    plugins = {p["plugin"]: p for p in json.loads(listing.stdout)}
    template = plugins["example-exact-match"]
    assert (template["distribution"], template["version"], template["status"]) == (DISTRIBUTION, "0.1.0", "ok")
    assert template["entries"] == [{"kind": "reward_scorer", "name": "example_exact_match", "status": "ok"}]

    used = python_run("""
        from rlplat import registry
        score = registry.get("reward_scorer", "example_exact_match")
        print(score("demo", " Paris ", "paris"), score("demo", "Lyon", "paris"))
    """)
    assert used.returncode == 0, used.stderr
    assert used.stdout.split() == ["1.0", "0.0"]

    own_tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(installed_template / "tests")],
        capture_output=True, text=True, timeout=300, cwd=installed_template,
    )
    assert own_tests.returncode == 0, own_tests.stdout + own_tests.stderr
    summary = own_tests.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def test_after_uninstall_the_template_is_gone(installed_template, cli_run):
    pip("uninstall", "--yes", DISTRIBUTION)
    listing = json.loads(cli_run("plugins", "list", "--json").stdout)
    assert "example-exact-match" not in {p["plugin"] for p in listing}
    assert pip("install", "--quiet", "--no-deps", "--no-build-isolation", str(installed_template)).returncode == 0
