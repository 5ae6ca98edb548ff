"""The weight-sync probe: it passes while the rollout serves the trainer's weights and stops the run,
naming the step, when a sync did not arrive."""

from __future__ import annotations

import pytest

from rlplat.config import load_config
from rlplat.config_node import ConfigError
from rlplat.trainer.sync_probe import SyncProbeError
from rlplat.testing.runs import fit_run
from rlplat.trainer.tracking import read_metrics
from rlplat.trainer import Trainer
from rlplat.testing.runs import doubling_overrides

pytestmark = pytest.mark.slow  # whole runs: left out of `make test-fast`


@pytest.fixture(scope="module")
def assets(doubling_assets):
    return doubling_assets


def overrides(assets, run, *extra):
    return doubling_overrides(assets, run, *extra)


class SkippedSync(Trainer):
    """A run whose rollout never receives the trained weights: the rollout's ``update_weights`` does
    nothing once the workers are built (a weight push that got lost)."""

    def build_workers(self) -> None:
        super().build_workers()
        rollout = self.actor.backend.host.workers["actor"].rollout
        rollout.update_weights = lambda named_tensors: None


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_the_probe_passes_after_every_sync_when_the_weights_arrive(assets, tmp_path, mode):
    config = load_config(overrides=overrides(assets, tmp_path, "rollout.sync_probe.freq=1", "rollout.sync_probe.tolerance=1e-5",
                                             f"trainer.mode={mode}", "trainer.max_staleness=0"), algo="grpo")
    records = fit_run(config)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["sync_probe/mean_abs_diff"] < 1e-6 and r["timing_s/sync_probe"] > 0 for r in records)


def test_a_sync_that_did_not_arrive_stops_the_run_at_the_first_probe(assets, tmp_path):
    config = load_config(overrides=overrides(assets, tmp_path, "rollout.share_weights=false", "rollout.sync_probe.tolerance=1e-5",
                                             "trainer.sentinel.weight_checks=false"),  # else the sentinel stops it first
                         algo="grpo")
    trainer = SkippedSync(config)
    try:
        with pytest.raises(SyncProbeError, match=r"sync_probe: after the weight sync the rollout's log-probs differ.*\(step 1, role rollout\)") as raised:
            trainer.fit()
    finally:
        trainer.shutdown()
    assert "probe prompt" in str(raised.value) and "did not arrive" in str(raised.value)
    assert [r["step"] for r in read_metrics(tmp_path)] == []  # stopped before step 1 was logged


def test_the_probe_runs_on_step_1_and_every_freq_th_step_by_default(assets, tmp_path):
    config = load_config(overrides=overrides(assets, tmp_path, "rollout.sync_probe.freq=2"), algo="grpo")
    assert [r["step"] for r in fit_run(config) if "sync_probe/mean_abs_diff" in r] == [1, 2, 4]


def test_a_bad_probe_node_is_refused_at_load(assets, tmp_path):
    with pytest.raises(ConfigError, match="rollout.sync_probe needs"):
        load_config(overrides=overrides(assets, tmp_path, "rollout.sync_probe.tolerance=0"), algo="grpo")
