"""The frozen third-party plugin (``tests/fixtures/frozen_plugin_api1``, never edited), installed as a user's
plugin is (conftest's ``PluginInstaller``): it loads, passes the conformance suites of its plugin API version
with its own tests, and trains the demo with its algorithm, estimator, loss and scorer. When a test here
fails, rlplat broke a plugin that followed its documentation: fix rlplat, never the fixture.

A plugin declaring a plugin API range this rlplat does not provide is listed as failed with the reason, and
a run that asks for its algorithm is refused, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import yaml

FROZEN = Path(__file__).resolve().parents[1] / "fixtures" / "frozen_plugin_api1"
DISTRIBUTION = "rlplat-frozen-plugin"
PACKAGE = "rlplat_frozen_plugin"
ENTRIES = [
    {"kind": "reward_scorer", "name": "frozen_last_number", "status": "ok"},
    {"kind": "advantage_estimator", "name": "frozen_leave_one_out", "status": "ok"},
    {"kind": "policy_loss", "name": "frozen_clipped_pg", "status": "ok"},
    {"kind": "algorithm", "name": "frozen_loo_pg", "status": "ok"},
    {"kind": "tool", "name": "frozen_word_count", "status": "ok"},
]
SHORT_RUN = ["trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
             "trainer.resume=disable"]


@pytest.fixture(scope="module")
def frozen_site(plugin_installer, tmp_path_factory) -> Iterator[Path]:
    site = plugin_installer.install(FROZEN, tmp_path_factory.mktemp("frozen-plugin"), DISTRIBUTION, PACKAGE)
    yield site
    plugin_installer.stop_processes_of(site)


def test_the_fixture_says_it_is_frozen():
    assert "frozen: never edit; every change to rlplat must keep it green" in (FROZEN / "README.md").read_text()


def test_it_loads_with_its_declared_api_range_and_every_entry_ok(frozen_site, cli_run):
    listing = cli_run("plugins", "list", "--json", pythonpath=frozen_site)
    assert listing.returncode == 0, listing.stderr
    frozen = {p["plugin"]: p for p in json.loads(listing.stdout)}["frozen"]
    assert (frozen["distribution"], frozen["version"], frozen["status"], frozen["reason"]) == (DISTRIBUTION, "1.0.0", "ok", None)
    assert frozen["plugin_api"] == ">=1.1,<2"
    assert frozen["entries"] == ENTRIES


def test_a_run_in_an_aggregation_mode_its_loss_does_not_declare_is_refused_before_it_starts(frozen_site, cli_run, tmp_path):
    result = cli_run("run", "--algo", "frozen_loo_pg", "actor.loss.loss_agg_mode=token-sum", *SHORT_RUN,
                     f"trainer.output_dir={tmp_path / 'run'}", pythonpath=frozen_site)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("actor.loss.loss_agg_mode=token-sum: the policy loss policy_loss 'frozen_clipped_pg' from rlplat-frozen-plugin "
            "1.0.0 (plugin 'frozen') supports only token-mean, seq-mean-token-sum, seq-mean-token-mean, "
            "seq-mean-token-sum-norm") in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_its_own_tests_pass_the_conformance_suites_of_its_api_version(frozen_site, plugin_installer):
    own_tests = plugin_installer.run_own_tests(frozen_site)
    assert own_tests.returncode == 0, own_tests.stdout[-5000:] + own_tests.stderr[-3000:]
    lines = own_tests.stdout.strip().splitlines()
    assert " passed" in lines[-1] and "failed" not in lines[-1] and "error" not in lines[-1], lines[-1]
    skipped = [line for line in lines if line.startswith("SKIPPED")]
    # its loss declares API 1.0's four modes: token-sum (two tests, two configs) is the only thing not asked
    assert len(skipped) == 1 and skipped[0].startswith("SKIPPED [4] ") and "token-sum is not asked of this loss" in skipped[0], skipped


@pytest.mark.slow
def test_its_algorithm_trains_the_demo_with_its_estimator_loss_and_scorer(frozen_site, cli_run, tmp_path, plugin_installer):
    run_dir = tmp_path / "run"
    result = cli_run("run", "--algo", "frozen_loo_pg", "reward.scorer=frozen_last_number", "algorithm.advantage_scale=2.0",
                     *SHORT_RUN, f"trainer.output_dir={run_dir}", pythonpath=frozen_site, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    algorithm = config["algorithm"]
    assert (algorithm["name"], algorithm["adv_estimator"], algorithm["advantage_scale"]) == (
        "frozen_loo_pg", "frozen_leave_one_out", 2.0)
    assert config["actor"]["loss"]["policy_loss"] == {"loss_mode": "frozen_clipped_pg", "clip": 0.2}
    assert config["reward"]["scorer"] == "frozen_last_number"  # (loss_agg_mode is the demo preset's token-mean)

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert 0.0 <= step["actor/pg_clipfrac"] <= 1.0  # the frozen loss's metric, from the workers
        assert 0.0 <= step["critic/score/mean"] <= 1.0 and "actor/grad_norm" in step
    assert plugin_installer.processes_with_in_environment(str(frozen_site)) == []


def test_a_plugin_declaring_an_api_rlplat_lacks_is_listed_failed_and_a_run_asking_for_it_is_refused(write_dist, site, cli_run, tmp_path):
    write_dist("rlplat-future-algorithms", "2.0.0", {"future-algorithms": "future_algorithms_plugin"}, {
        "future_algorithms_plugin": """
            import rlplat

            RLPLAT_PLUGIN_API = ">=2,<3"

            @rlplat.hookimpl
            def register_algorithms(register):
                register("future_algo", "future_algorithms_plugin:spec")
        """,
    })
    listing = cli_run("plugins", "list", "--json", pythonpath=site)
    future = {p["plugin"]: p for p in json.loads(listing.stdout)}["future-algorithms"]
    reason = "declares plugin API '>=2,<3' (RLPLAT_PLUGIN_API), but this rlplat provides plugin API 1.3.0"
    assert (future["status"], future["entries"]) == ("failed", []) and future["reason"].startswith(reason)

    run = cli_run("run", "--algo", "future_algo", *SHORT_RUN, f"trainer.output_dir={tmp_path / 'run'}", pythonpath=site)
    assert run.returncode == 2
    assert "unknown algorithm 'future_algo'" in run.stderr
    assert f"Plugins that failed to load: future-algorithms ({reason}" in run.stderr
    assert not (tmp_path / "run").exists()
