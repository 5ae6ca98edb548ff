"""The role workers with the built-in fsdp2 engine and hf rollout, found through the registry.

Two processes on Ray for the colocated (hybrid) layout; in process for separate groups and the critic.
"""

from __future__ import annotations

import pytest
import torch

from rlplat import DataProto, LocalWorkerGroup, RayWorkerGroup, ResourcePool, WorkerSpec
from rlplat.testing.rollouts import left_padded_prompts
from rlplat.testing.tiny_models import tiny_qwen2_config
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker, log_prob_mismatch
from rlplat.workers.critic import CriticWorker

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

PROMPTS = [[1, 5, 6, 14, 7, 8, 15], [1, 9, 14, 10, 15], [1, 6, 14, 6, 15], [1, 7, 7, 14, 5, 15]]


def worker_config(**overrides):
    model = tiny_qwen2_config().to_dict()
    config = {
        "engine_config": {"model_config": model, "lr": 1e-3, "ppo_mini_batch_size": 8, "micro_batch_size_per_gpu": 2, "seed": 3},
        "rollout_config": {"model_config": model, "load_weights": False},
        "sampling": {"n": 2, "max_new_tokens": 6, "seed": 0},
        "algorithm": "grpo",
    }
    config.update(overrides)
    return config


def with_advantages(batch: DataProto) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(len(batch), 1, generator=generator)
    advantages = (scores * batch.batch["response_mask"]).contiguous()
    return batch.union(DataProto.from_dict({"advantages": advantages}))


@pytest.fixture(scope="module")
def hybrid(local_ray):
    pool = ResourcePool([2])
    workers = RayWorkerGroup(pool, WorkerSpec(ActorRolloutRefWorker, worker_config()), role="actor_rollout_ref")
    workers.init_model()
    yield workers
    workers.shutdown()
    pool.release()


def test_after_a_sync_the_engine_and_the_rollout_agree_on_log_probs_before_and_after_an_update(hybrid):
    prompts = left_padded_prompts(PROMPTS, 0)
    batch = hybrid.generate_sequences(prompts)
    assert len(batch) == 8
    batch = batch.union(hybrid.compute_log_prob(batch)).union(hybrid.compute_ref_log_prob(batch))
    before = log_prob_mismatch(batch)
    assert before["rollout/log_prob_diff_max"] < 1e-4
    # before any update the reference is the actor
    assert torch.allclose(batch.batch["ref_log_prob"], batch.batch["old_log_probs"], atol=1e-6)

    metrics = hybrid.update_actor(with_advantages(batch)).meta_info["metrics"]
    assert len(metrics["actor/grad_norm"]) == 2 and metrics["actor/grad_norm"][0] > 0
    synced = hybrid.sync_weights()
    assert all(result["sync/bytes"] > 2e6 for result in synced)

    after = hybrid.generate_sequences(prompts)
    after = after.union(hybrid.compute_log_prob(after)).union(hybrid.compute_ref_log_prob(after))
    assert log_prob_mismatch(after)["rollout/log_prob_diff_max"] < 1e-4
    assert not torch.allclose(after.batch["ref_log_prob"], after.batch["old_log_probs"], atol=1e-4)


@pytest.fixture
def in_process_hybrid():
    # the copying sync (sleep frees the rollout's own weights); zero-copy is tested below
    workers = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config(share_weights=False)), role="actor_rollout_ref")
    workers.init_model()
    yield workers
    workers.shutdown()


def the_worker(group) -> ActorRolloutRefWorker:
    return group.backend.host.workers[group.role]


def test_sleep_frees_the_rollout_weights_and_wake_plus_sync_reproduces_generation(in_process_hybrid):
    prompts = left_padded_prompts(PROMPTS, 0)
    first = in_process_hybrid.generate_sequences(prompts)
    rollout = the_worker(in_process_hybrid).rollout
    held = rollout.parameter_bytes()
    in_process_hybrid.sleep_rollout()
    assert held > 2_000_000 and rollout.parameter_bytes() == 0
    in_process_hybrid.sync_weights()  # wakes the rollout, then loads every bucket
    second = in_process_hybrid.generate_sequences(prompts)
    assert rollout.parameter_bytes() == held
    # Exact: the rollout's weights (drawn from the config, load_weights=False) were fresh 64-byte aligned
    # allocations before the sleep and are again after the wake-up, holding the same values, and the seeded
    # sampler draws from the same rows in this process.
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    assert torch.equal(first.batch["rollout_log_probs"], second.batch["rollout_log_probs"])


def test_freeing_between_phases_sleeps_after_generating_and_a_second_generation_wakes_with_the_actor_weights():
    group = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config(free_rollout_between_phases=True, share_weights=False)),
                             role="actor_rollout_ref")
    try:
        group.init_model()
        rollout = the_worker(group).rollout
        prompts = left_padded_prompts(PROMPTS, 0)
        first = group.generate_sequences(prompts)
        assert rollout.parameter_bytes() == 0  # asleep while the actor trains
        second = group.generate_sequences(prompts)  # e.g. validation, then a step: no sync in between
        assert rollout.parameter_bytes() == 0
        assert torch.equal(first.batch["responses"], second.batch["responses"])
        group.sync_weights()
        assert rollout.parameter_bytes() > 2_000_000
    finally:
        group.shutdown()

def test_a_rollout_in_its_own_group_takes_weights_exported_by_the_actor_group():
    actor = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config(roles=["actor"])), role="actor")
    rollout = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config(roles=["rollout"])), role="rollout",
                               init_distributed=False)
    try:
        actor.init_model()
        rollout.init_model()
        rollout.load_weights(actor.call_async("export_weights"))
        batch = rollout.generate_sequences(left_padded_prompts(PROMPTS, 0))
        batch = batch.union(actor.compute_log_prob(batch))
        assert log_prob_mismatch(batch)["rollout/log_prob_diff_max"] < 1e-4
        with pytest.raises(Exception, match="needs the rollout role, which is not one of this worker's roles"):
            actor.generate_sequences(left_padded_prompts(PROMPTS, 0))
    finally:
        actor.shutdown()


def test_the_critic_predicts_values_and_its_loss_falls_on_a_fixed_batch(in_process_hybrid):
    batch = in_process_hybrid.generate_sequences(left_padded_prompts(PROMPTS, 0))
    critic_config = {"engine_config": {"model_config": tiny_qwen2_config().to_dict(), "lr": 3e-4, "seed": 5}, "algorithm": "ppo"}
    critic = LocalWorkerGroup(WorkerSpec(CriticWorker, critic_config), role="critic", init_distributed=False)
    critic.init_model()
    values = critic.compute_values(batch).batch["values"]
    assert values.shape == batch.batch["responses"].shape
    returns = (torch.linspace(-1, 1, len(batch))[:, None] * batch.batch["response_mask"]).contiguous()
    train = batch.union(DataProto.from_dict({"values": values, "returns": returns}))
    losses = [critic.update_critic(train).meta_info["metrics"]["critic/vf_loss"][0] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0]


def storages(tensors) -> dict[int, int]:
    """Bytes of each distinct storage behind ``tensors``, by its address."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def test_in_one_process_the_rollout_reads_the_engine_weights_in_place_and_samples_from_each_update():
    group = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config()), role="actor_rollout_ref")
    reference = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config(roles=["rollout"])), role="copying",
                                 init_distributed=False)
    try:
        group.init_model()
        worker = the_worker(group)
        engine_storages = storages(tensor for _, tensor in worker.actor.shared_weights())
        rollout_storages = storages(worker.rollout.model.parameters())
        # one copy of the model: every rollout weight lives in the engine's storage, none of its own
        assert set(rollout_storages) <= set(engine_storages)
        own = sum(size for address, size in rollout_storages.items() if address not in engine_storages)
        assert own == 0 and sum(engine_storages.values()) > 2_000_000

        prompts = left_padded_prompts(PROMPTS, 0)
        for step in range(2):
            batch = group.generate_sequences(prompts)
            batch = batch.union(group.compute_log_prob(batch)).union(group.compute_ref_log_prob(batch))
            assert log_prob_mismatch(batch)["rollout/log_prob_diff_max"] < 1e-4
            group.update_actor(with_advantages(batch))
            (report,) = group.sync_weights()
            assert report["sync/shared"] == 1.0 and report["sync/bytes"] == 0.0
            # the next samples come from the updated weights: the same as a rollout given a copy of them
            if step == 0:
                reference.init_model()
            copier = the_worker(reference)
            for bucket in worker.actor.named_weights():
                copier.rollout.update_weights(bucket)
            shared = group.generate_sequences(prompts)
            copied = reference.generate_sequences(prompts)
            # Both rollouts read the same values from 64-byte aligned allocations (the engine's parameters,
            # the copier's own) and decode the same rows, so the same seed draws the same tokens.
            assert torch.equal(shared.batch["responses"], copied.batch["responses"])
            assert torch.allclose(shared.batch["rollout_log_probs"], copied.batch["rollout_log_probs"], atol=1e-6)
        assert storages(worker.rollout.model.parameters()).keys() <= engine_storages.keys()
    finally:
        group.shutdown()
        reference.shutdown()
