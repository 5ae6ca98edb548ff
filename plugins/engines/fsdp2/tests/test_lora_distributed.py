"""LoRA on two CPU processes under Ray (gloo, FSDP2 shards of 1/2 over the model with peft's adapters)
against one process in the in-process backend, on the same global batches, float32.

Tolerances are test_fsdp2_distributed's: 2 ranks vs 1 <= 1e-5 on the loss (relative) and on the merged
weights after a step. Its worker is not importable from here (pytest imports test modules by path),
hence a small one.
"""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch

from rlplat import DataProto, Dispatch, LocalWorkerGroup, RayWorkerGroup, ResourcePool, Worker, WorkerSpec, register
from rlplat.controller.worker import without_padding_weight
from rlplat.testing.distributed import max_difference
from rlplat.testing.engines import TINY_QWEN2
from rlplat_engine_fsdp2.engine import FSDP2Engine

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BASE = dict(
    model_config=dict(TINY_QWEN2),
    seed=7,
    lr=1e-2,
    dtype="float32",
    micro_batch_size_per_gpu=2,
    lora={"rank": 4, "alpha": 8.0},
)


def policy_gradient(outputs, micro_batch):
    """Token-mean surrogate ``-sum(advantages * log_probs * mask) / global_token_count``."""
    batch = micro_batch.batch
    return -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"], {}


class LoraHost(Worker):
    """Holds named engines built from ``BASE`` with overrides; every method runs on every rank."""

    def __init__(self):
        super().__init__()
        self.engines: dict[str, FSDP2Engine] = {}

    @register(Dispatch.ONE_TO_ALL)
    def build(self, name: str, overrides: dict) -> None:
        self.engines[name] = FSDP2Engine(BASE, **overrides)
        self.engines[name].init_model()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def forward(self, name: str, batch: DataProto, reference: bool = False) -> DataProto:
        engine = self.engines[name]
        if not reference:
            return engine.forward(batch)
        with engine.adapter_disabled():
            return engine.forward(batch)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def train(self, name: str, batch: DataProto) -> dict:
        return self.engines[name].train_batch(without_padding_weight(batch, self.padding_rows), policy_gradient)

    @register(Dispatch.ONE_TO_ALL)
    def merged_weights(self, name: str) -> dict:
        return {key: tensor.clone() for bucket in self.engines[name].named_weights() for key, tensor in bucket}

    @register(Dispatch.ONE_TO_ALL)
    def adapter(self, name: str) -> dict:
        return dict(self.engines[name].adapter_weights()[1])

    @register(Dispatch.ONE_TO_ALL)
    def save(self, name: str, path: str) -> None:
        self.engines[name].save(path)

    @register(Dispatch.ONE_TO_ALL)
    def load(self, name: str, path: str) -> None:
        self.engines[name].load(path)


@pytest.fixture(scope="module")
def two_ranks(ray_cluster):
    pool = ResourcePool([2])
    group = RayWorkerGroup(pool, WorkerSpec(LoraHost), role="actor")
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def one_rank():
    group = LocalWorkerGroup(WorkerSpec(LoraHost), role="actor")
    yield group
    group.shutdown()


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_a_two_rank_lora_step_equals_a_one_rank_step_and_the_reference_stays_the_base(two_ranks, one_rank, batch_of, use_remove_padding):
    name = f"step-{use_remove_padding}"
    batch = batch_of(8).with_meta_info({"ppo_mini_batch_size": 8})
    for group in (two_ranks, one_rank):
        group.build(name, {"use_remove_padding": use_remove_padding})
    actor, reference = two_ranks.forward(name, batch), two_ranks.forward(name, batch, reference=True)
    assert torch.equal(actor.batch["log_probs"], reference.batch["log_probs"])  # step 0: lora_B is zero
    initial = one_rank.merged_weights(name)[0]
    two_rank_metrics, one_rank_metrics = two_ranks.train(name, batch)[0], one_rank.train(name, batch)[0]
    after_two, after_one = two_ranks.merged_weights(name)[0], one_rank.merged_weights(name)[0]
    difference = max_difference(after_two, after_one)
    print(f"LoRA, 2 ranks vs 1 rank, max |merged weight difference| after one step: {difference:.3g}")
    assert difference <= 1e-5 and max_difference(after_one, initial) >= 1e-4
    assert two_rank_metrics["loss"] == pytest.approx(one_rank_metrics["loss"], rel=1e-5, abs=1e-7)
    assert two_rank_metrics["grad_norm"] == pytest.approx(one_rank_metrics["grad_norm"], rel=1e-5)
    # Each rank holds half of every adapter tensor's optimizer state; the count is the whole adapter's.
    assert two_rank_metrics["trainable_params"] == one_rank_metrics["trainable_params"] == 23552
    assert two_rank_metrics["optimizer_state_bytes"] < one_rank_metrics["optimizer_state_bytes"]
    assert torch.equal(two_ranks.forward(name, batch, reference=True).batch["log_probs"], reference.batch["log_probs"])
    assert max_difference(two_ranks.adapter(name)[0], one_rank.adapter(name)[0]) <= 1e-5


def test_a_two_rank_adapter_checkpoint_resumes_exactly(two_ranks, batch_of, tmp_path):
    # The same seed builds the same base weights from the config; the adapter trains away from its start.
    for name in ("uninterrupted", "resumed"):
        two_ranks.build(name, {})
    two_ranks.train("uninterrupted", batch_of(8, seed=0))
    two_ranks.save("uninterrupted", str(tmp_path / "checkpoint"))
    two_ranks.load("resumed", str(tmp_path / "checkpoint"))
    for seed in (1, 2):
        assert two_ranks.train("resumed", batch_of(8, seed=seed)) == two_ranks.train("uninterrupted", batch_of(8, seed=seed))
    assert max_difference(two_ranks.merged_weights("resumed")[0], two_ranks.merged_weights("uninterrupted")[0]) == 0.0
