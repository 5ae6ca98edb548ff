"""Ulysses sequence parallelism through the whole loop: GRPO on the built-in demo with an SP=2 fsdp2 actor on two
Ray processes (one data-parallel group: both ranks get every row of the actor's calls, rank 0 answers; the hf
rollout still generates on both ranks' shares). After every sync the probe finds the rollout scoring what the
actor scores, and the actor's old log-probs (computed with each rank running half of every pack) agree with the
rollout's own."""

from __future__ import annotations

import math

import pytest

from rlplat import load_config
from rlplat.testing import fit_run
from rlplat_demo import overrides

pytestmark = pytest.mark.slow


def test_grpo_with_a_sequence_parallel_actor_trains_and_scores_what_the_rollout_scores(tmp_path):
    """The token budget is 10 tokens a process, which only a group of two holds a demo sequence in (up to 16 prompt
    + 4 response tokens): the run fails unless the actor runs sequence-parallel."""
    config = load_config(
        overrides=[
            *overrides(), "actor.engine_config.ulysses_sequence_parallel_size=2", "actor.use_dynamic_bsz=true",
            "actor.max_token_len_per_gpu=10", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "cluster.backend=ray",
            "cluster.devices_per_node=2", "cluster.threads_per_process=1", "trainer.total_training_steps=3",
            "trainer.test_freq=3", "trainer.save_freq=1000", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            f"trainer.output_dir={tmp_path / 'run'}", "rollout.sync_probe.freq=1", "rollout.sync_probe.tolerance=1e-5",
        ],
        algo="grpo", engine="fsdp2", rollout="hf",
    )
    records = [record for record in fit_run(config) if "actor/loss" in record]
    assert len(records) == 3
    for record in records:
        assert math.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0, record
        assert record["sync_probe/max_abs_diff"] <= 1e-5
        assert record["rollout/log_prob_diff_max"] < 1e-4
