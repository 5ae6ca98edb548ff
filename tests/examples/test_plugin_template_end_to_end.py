"""The plugin template end to end, installed as a user's plugin would be but into a folder of its own
(``pip install --no-deps --target``) that only the subprocesses see on PYTHONPATH: listed, cheap to list,
usable, passing its own conformance tests, and training the demo with its own algorithm. Nothing is
installed into this venv.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import yaml

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "plugin-template"
DISTRIBUTION = "rlplat-plugin-template"
PACKAGE = "rlplat_plugin_template"
ENTRIES = [
    {"kind": "reward_scorer", "name": "example_exact_match", "status": "ok"},
    {"kind": "advantage_estimator", "name": "example_group_median", "status": "ok"},
    {"kind": "policy_loss", "name": "example_truncated_is", "status": "ok"},
    {"kind": "algorithm", "name": "example_median_reinforce", "status": "ok"},
]


@pytest.fixture(scope="module")
def template_site(plugin_installer, tmp_path_factory) -> Iterator[Path]:
    """The template installed with ``pip install --no-deps --target`` (conftest's ``PluginInstaller``)."""
    site = plugin_installer.install(TEMPLATE, tmp_path_factory.mktemp("plugin-template"), DISTRIBUTION, PACKAGE)
    yield site
    plugin_installer.stop_processes_of(site)


def test_the_installed_template_is_listed_with_all_its_entries_ok(template_site, cli_run):
    listing = cli_run("plugins", "list", "--json", pythonpath=template_site)
    assert listing.returncode == 0, listing.stderr
    template = {p["plugin"]: p for p in json.loads(listing.stdout)}["example-plugin"]
    assert (template["distribution"], template["version"], template["status"]) == (DISTRIBUTION, "0.1.0", "ok")
    assert template["entries"] == ENTRIES


def test_listing_plugins_imports_no_torch_and_none_of_the_templates_implementations(template_site, python_run):
    result = python_run(f"""
        import sys
        from rlplat.cli.main import main
        try:
            main(["plugins", "list"])
        except SystemExit as exit:
            assert not exit.code, exit.code
        import {PACKAGE}.plugin
        print("FROM", {PACKAGE}.plugin.__file__)
        print("LOADED", sorted(m for m in sys.modules if m == "torch" or m.startswith("{PACKAGE}.")))
    """, pythonpath=template_site)
    assert result.returncode == 0, result.stderr
    *_, loaded_from, loaded = result.stdout.strip().splitlines()
    assert loaded_from == f"FROM {template_site / PACKAGE / 'plugin.py'}"
    assert loaded == f"LOADED ['{PACKAGE}.plugin']"


def test_the_installed_entries_work_through_the_registry(template_site, python_run):
    result = python_run("""
        import numpy as np, torch
        from rlplat import registry
        score = registry.get("reward_scorer", "example_exact_match")
        print(score("demo", " Paris ", "paris"), score("demo", "Lyon", "paris"))
        estimate = registry.get("advantage_estimator", "example_group_median")
        advantages, _ = estimate(torch.tensor([[1.0], [0.0], [0.0], [2.0]]), torch.ones(4, 1), np.array(list("aaab")))
        print(advantages.squeeze(-1).tolist())
        print(registry.get("algorithm", "example_median_reinforce")().policy_loss)
    """, pythonpath=template_site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["1.0 0.0", "[1.0, 0.0, 0.0, 0.0]", "example_truncated_is"]


def test_without_its_folder_on_the_path_the_template_is_not_there(template_site, cli_run, plugin_installer):
    listing = cli_run("plugins", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    assert DISTRIBUTION not in {p["distribution"] for p in json.loads(listing.stdout)}
    assert plugin_installer.pip("show", DISTRIBUTION).returncode != 0


@pytest.mark.slow
def test_the_templates_own_conformance_tests_pass_against_the_installed_copy(template_site, plugin_installer):
    own_tests = plugin_installer.run_own_tests(template_site)
    assert own_tests.returncode == 0, own_tests.stdout + own_tests.stderr
    lines = own_tests.stdout.strip().splitlines()
    assert " passed" in lines[-1] and "failed" not in lines[-1] and "error" not in lines[-1], lines[-1]
    assert [line for line in lines if line.startswith("SKIPPED")] == []


@pytest.mark.slow
def test_the_templates_algorithm_trains_the_demo_with_its_own_estimator_and_loss(template_site, cli_run, tmp_path,
                                                                                 plugin_installer):
    run_dir = tmp_path / "run"
    result = cli_run(
        "run", "--algo", "example_median_reinforce", "trainer.total_training_steps=2", "trainer.test_freq=0",
        "trainer.val_before_train=false", f"trainer.output_dir={run_dir}", "trainer.resume=disable",
        pythonpath=template_site, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training the built-in demo (example_median_reinforce, preset arith)" in result.stderr

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (config["algorithm"]["name"], config["algorithm"]["adv_estimator"]) == (
        "example_median_reinforce", "example_group_median")
    assert config["actor"]["loss"]["policy_loss"] == {"loss_mode": "example_truncated_is"}

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        # The template loss's own metric, reported by the fsdp2 workers; the default loss's is absent.
        assert 0.0 <= step["actor/is_truncated_frac"] <= 1.0
        assert "actor/pg_clipfrac" not in step
        assert "critic/advantages/mean" in step and "actor/grad_norm" in step
    assert plugin_installer.processes_with_in_environment(str(template_site)) == []
