"""A tiny mixture-of-experts policy through the whole loop: 20 GRPO steps of the demo's task on the fsdp2
engine and the hf rollout, with the rollout's routes replayed in training (r3) and with the engine's own (r2)."""

from __future__ import annotations

import math

import pytest

from rlplat.config import load_config
from rlplat.testing.runs import fit_run
from rlplat.testing.tiny_models import save_tiny_moe_model

pytestmark = pytest.mark.slow  # whole runs: left out of `make test-fast`


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return save_tiny_moe_model(tmp_path_factory.mktemp("moe_run") / "model", "qwen2_moe", seed=0)


def run(tmp_path, moe_model, *extra):
    from rlplat_demo import overrides

    config = load_config(overrides=[
        *overrides(), f"model.path={moe_model}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
        "actor.micro_batch_size_per_gpu=16", "trainer.total_training_steps=20", "trainer.test_freq=10",
        "trainer.val_before_train=false", "trainer.save_freq=0", f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.logger=[jsonl]", "cluster.threads_per_process=1", "actor.moe.aux_loss_coef=0.01", *extra], algo="grpo")
    return [record for record in fit_run(config) if "actor/loss" in record]


@pytest.mark.parametrize("mode, extra", [("r3", []), ("r2", ["actor.recompute_old_log_prob=always"])])
def test_a_tiny_moe_trains_20_grpo_steps_with_router_replay(tmp_path, moe_model, mode, extra):
    steps = run(tmp_path, moe_model, f"actor.moe.router_replay={mode}", *extra)
    assert len(steps) == 20
    for record in steps:
        assert record["actor/moe/replayed_fraction"] == 1.0, record  # every route that matters was replayed
        assert math.isfinite(record["actor/loss"]) and math.isfinite(record["actor/grad_norm"])
        assert 1.0 <= record["actor/moe/load_imbalance"] <= 8.0 and record["actor/moe/aux_loss"] > 0
        # the rollout and the trainer hold the same float32 weights and route alike
        assert record["rollout/log_prob_diff_max"] < 1e-4, record["rollout/log_prob_diff_max"]
    if mode == "r3":  # the rollout's routes: the update's forward routes them exactly as sampled
        assert all(record["actor/moe/replay_agreement"] == 1.0 for record in steps)
