"""The run sentinel: each fault, injected on CPU (rlplat.testing.faults), stops the run with its named error
within two steps, or is logged and counted under a ``warn`` policy; a clean run reports nothing; status.json
says where the run is."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlplat.config import load_config
from rlplat.config_node import ConfigError
from rlplat.contracts.health import (HealthEvent, NonFiniteError, PolicyVersionError, RunHealthError, WeightCorruptedError,
                                     WeightSyncSkippedError)
from rlplat.kits.weights import compare, differs, fingerprint
from rlplat.testing import faults
from rlplat.testing.runs import fit_run
from rlplat.trainer import Trainer
from rlplat.trainer.sentinel import CollapseWarning, Sentinel, SentinelConfig
from rlplat.trainer.status import read_status
from rlplat.trainer.tracking import read_metrics
from rlplat.testing.runs import doubling_overrides


@pytest.fixture(scope="module")
def assets(doubling_assets):
    return doubling_assets


def overrides(assets, run, *extra):
    return doubling_overrides(assets, run, "rollout.share_weights=false", *extra)  # copied weights: fingerprinted


def fails_with(config, error_type, match):
    trainer = Trainer(config)
    try:
        with pytest.raises(error_type, match=match) as raised:
            trainer.fit()
    finally:
        trainer.shutdown()
    return raised.value


# -- the fault matrix ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_clean_run_reports_nothing_and_checks_every_sync(assets, tmp_path):
    records = fit_run(load_config(overrides=overrides(assets, tmp_path, "rollout.sync_probe.freq=1"), algo="grpo"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["sentinel/events"] == 0 for r in records)
    assert all(r["sentinel/weights_verified"] == 1 for r in records)  # every sync fingerprinted and matched
    status = read_status(tmp_path)
    assert status["state"] == "finished" and status["step"] == 4 and status["sentinel"] == []
    assert status["replicas"] == {"rollout/0": "healthy"}


@pytest.mark.slow
def test_a_skipped_weight_sync_stops_the_run_at_the_next_step(assets, tmp_path):
    with faults.skipped_weight_sync(at_step=2):
        error = fails_with(load_config(overrides=overrides(assets, tmp_path), algo="grpo"), WeightSyncSkippedError,
                           r"sampled from policy version 1, but the trainer had synced version 2")
    assert error.step == 3 and error.figures["stale_rows"] == 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    status = read_status(tmp_path)
    assert status["state"] == "failed" and status["error"]["type"] == "WeightSyncSkippedError"
    assert status["sentinel"][-1]["check"] == "weight_sync" and status["sentinel"][-1]["action"] == "stop"


@pytest.mark.slow
def test_a_tensor_corrupted_on_the_rollout_is_named(assets, tmp_path):
    with faults.corrupted_rollout_tensor(from_sync=2):
        error = fails_with(load_config(overrides=overrides(assets, tmp_path), algo="grpo"), WeightCorruptedError,
                           r"after the weight sync to version 1, 1 of \d+ tensors the rollout holds differ")
    assert error.step in (1, 2) and error.figures["differ"] == 1 and error.rank == 0 and error.role == "rollout"


@pytest.mark.slow
def test_a_version_bumped_without_an_applied_sync_is_refused(assets, tmp_path):
    with faults.version_bumped_without_apply(from_sync=2):
        error = fails_with(load_config(overrides=overrides(assets, tmp_path), algo="grpo"), PolicyVersionError,
                           r"sampled from policy version 1, but the last weights whose apply it acknowledged are version 0")
    assert error.step in (1, 2)


@pytest.mark.slow
def test_nan_advantages_stop_the_run(assets, tmp_path):
    with faults.non_finite_advantages(at_step=2):
        error = fails_with(load_config(overrides=overrides(assets, tmp_path), algo="grpo"), NonFiniteError,
                           r"1 advantages of valid tokens are NaN or Inf \(rows \[0\]\)")
    assert error.step == 2


@pytest.mark.slow
def test_a_nan_loss_stops_the_run(assets, tmp_path):
    with faults.non_finite_loss(at_step=2):
        error = fails_with(load_config(overrides=overrides(assets, tmp_path), algo="grpo"), NonFiniteError,
                           r"non-finite update metrics")
    assert error.step == 2 and error.role == "actor"
    assert any(not math.isfinite(value) for values in error.figures.values() for value in values)


@pytest.mark.slow
def test_under_a_warn_policy_the_run_goes_on_and_counts_the_fault(assets, tmp_path, caplog):
    with faults.non_finite_advantages(at_step=2), caplog.at_level("WARNING", logger="rlplat.sentinel"):
        records = fit_run(load_config(overrides=overrides(assets, tmp_path, "trainer.sentinel.policy={non_finite: warn}",
                                                          "trainer.total_training_steps=3"), algo="grpo"))
    # the NaN advantage, then the NaN loss it made (the engine skipped that optimizer step)
    assert [r["sentinel/events"] for r in records] == [0, 2, 0]
    assert records[1]["sentinel/non_finite"] == 2 and records[1]["actor/skipped_step"] == 1
    assert "NonFiniteError" in caplog.text
    assert read_status(tmp_path)["sentinel"][0]["action"] == "warn"


@pytest.mark.slow
def test_off_silences_a_check(assets, tmp_path):
    with faults.skipped_weight_sync(at_step=1):
        records = fit_run(load_config(overrides=overrides(assets, tmp_path, "trainer.sentinel.policy={weight_sync: off}",
                                                          "trainer.total_training_steps=2"), algo="grpo"))
    assert [r["sentinel/events"] for r in records] == [0, 0]


# -- asynchronous training without a correction -------------------------------------------------------


@pytest.mark.parametrize("extra, refused", [
    ([], True),
    (["algorithm.rollout_correction.allow_uncorrected=true"], False),
    (["algorithm.rollout_correction.preset=decoupled_token_is"], False),
    (["trainer.max_staleness=0"], False),
])
def test_async_training_with_stale_samples_needs_a_rollout_correction(assets, tmp_path, extra, refused):
    config = overrides(assets, tmp_path, "trainer.mode=colocate_async", "trainer.max_staleness=1", *extra)
    if refused:
        with pytest.raises(ConfigError, match=r"allow_uncorrected=true"):
            load_config(overrides=config, algo="grpo")
    else:
        load_config(overrides=config, algo="grpo")


# -- the pieces ---------------------------------------------------------------------------------------


def test_fingerprints_pass_a_copy_and_a_bf16_rounding_and_catch_one_changed_element():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator)
    assert differs(fingerprint(weight), fingerprint(weight.clone())) is None
    assert differs(fingerprint(weight), fingerprint(weight.to(torch.bfloat16))) is None
    changed = weight.clone()
    changed[3, 4] += 0.5
    assert "held" in differs(fingerprint(weight), fingerprint(changed))
    assert differs(fingerprint(weight), fingerprint(weight * 1.1)) is not None
    nan = weight.clone()
    nan[0, 0] = float("nan")
    assert differs(fingerprint(weight), fingerprint(nan)) is not None
    compared, problems = compare({"a": fingerprint(weight), "b": fingerprint(weight)},
                                 {"a": fingerprint(weight), "b": fingerprint(changed), "c": fingerprint(weight)})
    assert compared == 2 and list(problems) == ["b"]


def test_a_fingerprint_reads_a_large_tensor_in_chunks(monkeypatch):
    from rlplat.kits import weights

    tensor = torch.arange(10_000, dtype=torch.float32)
    whole = fingerprint(tensor)
    monkeypatch.setattr(weights, "CHUNK_ELEMENTS", 999)
    assert differs(whole, weights.fingerprint(tensor)) is None


def test_collapse_is_a_warning_against_the_early_steps(caplog):
    sentinel = Sentinel(SentinelConfig(collapse_ratio=0.1, baseline_steps=2))
    with caplog.at_level("WARNING", logger="rlplat.sentinel"):
        for step, entropy in enumerate([1.0, 2.0, 0.5, 0.21], start=1):
            sentinel.check_collapse({"actor/entropy": [entropy], "response_length/mean": 10.0}, step)
        assert sentinel.counts == {}
        sentinel.check_collapse({"actor/entropy": 0.1, "response_length/mean": 10.0}, 5)
    assert sentinel.counts == {"collapse": 1} and "below 0.1 x its early value 2" in caplog.text
    sentinel = Sentinel(SentinelConfig(policy={"collapse": "stop"}, baseline_steps=1))
    sentinel.check_collapse({"response_length/mean": 40.0}, 1)
    with pytest.raises(CollapseWarning, match="response_length/mean is 1"):
        sentinel.check_collapse({"response_length/mean": 1.0}, 2)


def test_the_meta_info_key_is_the_one_concat_joins():
    from rlplat.contracts.health import HEALTH_EVENTS
    from rlplat.protocol.values import HEALTH_EVENTS_KEY

    assert HEALTH_EVENTS == HEALTH_EVENTS_KEY


def test_events_become_their_named_errors_with_step_role_rank_and_figures():
    error = HealthEvent("scorer", "killed after 2 s", role="reward", rank=1, figures={"killed": 2}).error(step=7)
    assert type(error).__name__ == "ScorerHungError" and isinstance(error, RunHealthError)
    assert (error.step, error.role, error.rank, error.figures) == (7, "reward", 1, {"killed": 2})
    assert str(error) == "scorer: killed after 2 s (step 7, role reward, rank 1)"
    meta = {"health_events": [HealthEvent("template", "drifted").as_dict()]}
    sentinel = Sentinel(SentinelConfig())
    sentinel.take_events(meta, 3)
    assert "health_events" not in meta and sentinel.step_metrics() == {"sentinel/template": 1.0, "sentinel/events": 1.0}


@pytest.mark.parametrize("node, match", [
    ({"policy": {"weight_sinc": "stop"}}, r"unknown checks \['weight_sinc'\]"),
    ({"policy": {"scorer": "ignore"}}, r"policies must be one of stop, warn, off"),
    ({"collapse_ratio": 1.5}, "collapse_ratio must be in"),
])
def test_a_bad_sentinel_node_is_refused_at_load(assets, tmp_path, node, match):
    dotted = [f"trainer.sentinel.{key}={json.dumps(value).replace(chr(34), '')}" for key, value in node.items()]
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides(assets, tmp_path, *dotted), algo="grpo")


@pytest.mark.slow
def test_a_restarted_rollout_is_refreshed_before_it_serves(assets, tmp_path):
    # generation 1 is step 1's, 2 the probe after its sync, 3 step 2's: the engine comes back with step 0's weights
    with faults.restarted_rollout(at_generation=3):
        records = fit_run(load_config(overrides=overrides(assets, tmp_path, "rollout.sync_probe.freq=1",
                                                          "rollout.sync_probe.tolerance=1e-5"), algo="grpo"))
    assert [r.get("sentinel/replica", 0) for r in records] == [0, 1, 0, 0]
    assert all(r["sync_probe/mean_abs_diff"] < 1e-5 for r in records)  # the refreshed weights are the actor's
    event = read_status(tmp_path)["sentinel"][0]
    assert event["check"] == "replica" and event["action"] == "warn" and event["figures"]["refreshed"] is True
    assert "restarted" in event["message"] and event["step"] == 2


def test_a_restarted_rollout_without_an_actor_in_its_process_refuses_to_serve(assets):
    from rlplat.contracts.health import StaleReplicaError
    from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker({"roles": ["rollout"], "rollout": "hf", "rollout_config": {"model_path": assets["model"]},
                                    "tokenizer_path": assets["model"]})
    worker.init_model()
    worker.check_instance(worker.rollout)  # nothing sent yet: nothing to compare
    worker.acked_instance, worker.acked_version = "first", 3
    worker.rollout.instance_id = lambda: "second"
    with pytest.raises(StaleReplicaError, match=r"restarted \(first -> second\) since it was sent policy version 3"):
        worker.check_instance(worker.rollout)


REGEX_TRAP = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 4 == 0:  # half the prompts: 2**40 steps of backtracking inside one C call holding the GIL
        re.match(r"(a+)+$", "a" * 40 + "b")
    return float(solution_str.strip() == ground_truth)
'''


@pytest.mark.slow
@pytest.mark.parametrize("manager, policy", [("naive", "warn"), ("async", "stop")])  # each manager, each policy once
def test_a_scorer_stuck_in_regex_backtracking_is_killed_and_reported(assets, tmp_path, cli_run, manager, policy):
    scorer = tmp_path / "trap.py"
    scorer.write_text(REGEX_TRAP)
    run = tmp_path / policy
    common = [*overrides(assets, run, f"reward.custom_function.path={scorer}", "reward.scorer=null",
                         f"reward.manager={manager}", "reward.config.timeout_s=1", "trainer.total_training_steps=3",
                         "rollout.share_weights=true", f"trainer.sentinel.policy={{scorer: {policy}}}")]
    result = cli_run("run", *common, timeout=300)  # hung forever before scorers ran in killable processes
    if policy == "stop":
        assert result.returncode != 0 and "ScorerHungError: scorer:" in result.stderr, result.stderr[-3000:]
        assert read_status(run)["state"] == "failed"
        return
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run)
    assert sum(r["reward/killed"] for r in records) >= 1 and sum(r.get("sentinel/scorer", 0) for r in records) >= 1
    events = read_status(run)["sentinel"]
    assert events and all(e["error"] == "ScorerHungError" and e["action"] == "warn" for e in events)
