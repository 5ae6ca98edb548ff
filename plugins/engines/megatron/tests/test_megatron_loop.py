"""The megatron engine through the whole loop: PPO on the built-in demo with a PP=2 actor (Ray, two CPU
processes) and a PP=2 megatron critic (value head) in the same processes, three steps, the weight-sync
probe checking after every sync that the rollout scores what the actor scores (named_weights gathered from
both stages feeding the hf rollout). With pipeline stages the first stage computes no loss, so this also
covers the actor worker's on-policy update, whose old log-probs come from the last stage only. (GRPO with
a TP=2 actor on the demo is measured in the README.) The same with a CP=2 actor and critic, two steps; GRPO
with an expert-parallel MoE actor."""

from __future__ import annotations

import math

import pytest

from rlplat import load_config
from rlplat_demo import overrides
from rlplat.testing import fit_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout, steps", [("pipeline_parallel_size", 3), ("context_parallel_size", 2)], ids=["pp2", "cp2"])
def test_ppo_with_a_two_rank_megatron_actor_and_critic_trains_and_the_rollout_gets_the_weights(tmp_path, layout, steps):
    """PP=2 (each process a pipeline stage) or CP=2 (each process running half of every row's tokens) for the
    actor, its reference and a value-model critic: the rollout scores what the actor scores after every sync,
    and the rollout's log-probs are the actor's."""
    config = load_config(
        overrides=[
            *overrides(), "critic.engine=megatron", f"actor.engine_config.{layout}=2", f"critic.engine_config.{layout}=2",
            "cluster.backend=ray", "cluster.devices_per_node=2", "cluster.threads_per_process=1",
            f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=1000",
            "trainer.val_before_train=false", "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path / 'run'}",
            "rollout.sync_probe.freq=1", "rollout.sync_probe.tolerance=1e-5",
        ],
        algo="ppo", engine="megatron", rollout="hf",
    )
    records = [record for record in fit_run(config) if "critic/vf_loss" in record]
    assert len(records) == steps
    for record in records:
        for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(record[key]), (key, record[key])
        assert record["critic/grad_norm"] > 0 and record["actor/grad_norm"] > 0
        assert record["sync_probe/max_abs_diff"] <= 1e-5 and record["rollout/log_prob_diff_max"] < 1e-4


def test_grpo_with_an_expert_parallel_moe_actor_replays_the_rollouts_routes_and_syncs_every_expert(tmp_path):
    """A tiny Qwen2-MoE policy on a megatron actor with EP=2 (two Ray processes, each holding 4 of the 8 experts
    of every layer), the hf rollout recording its routes, r3 replay and the load-balancing loss: every route that
    matters is replayed and agrees (the same float32 weights), and the sync probe finds the rollout scoring what
    the actor scores after every sync (every expert gathered from its rank, fused by the rollout)."""
    from rlplat.testing.tiny_models import save_tiny_moe_model

    model = save_tiny_moe_model(tmp_path / "model", "qwen2_moe", seed=0)
    config = load_config(
        overrides=[
            *overrides(), f"model.path={model}", "actor.engine_config.expert_model_parallel_size=2", "cluster.backend=ray",
            "cluster.devices_per_node=2", "cluster.threads_per_process=1", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8", "rollout.n=4", "trainer.total_training_steps=3", "trainer.test_freq=3",
            "trainer.save_freq=1000", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path / 'run'}", "rollout.sync_probe.freq=1", "rollout.sync_probe.tolerance=1e-5",
            "actor.moe.router_replay=r3", "actor.moe.aux_loss_coef=0.01",
        ],
        algo="grpo", engine="megatron", rollout="hf",
    )
    records = [record for record in fit_run(config) if "actor/loss" in record]
    assert len(records) == 3
    for record in records:
        assert record["actor/moe/replayed_fraction"] == 1.0 and record["actor/moe/replay_agreement"] == 1.0, record
        assert record["actor/moe/aux_loss"] > 0 and 1.0 <= record["actor/moe/load_imbalance"] <= 8.0
        assert math.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0
        assert record["sync_probe/max_abs_diff"] <= 1e-5
        assert record["rollout/log_prob_diff_max"] < 1e-4
