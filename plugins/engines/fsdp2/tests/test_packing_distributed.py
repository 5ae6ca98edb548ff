"""Packing and shared weights on two CPU processes under Ray (gloo, FSDP2 shards of 1/2): a packed
two-rank update equals a padded one-rank update on the same global batch; ``shared_weights`` is None
when parameters are sharded.

Tolerances are test_fsdp2_distributed's: 2 ranks vs 1 <= 1e-5 on parameters after a step. Its worker
(``EngineHost``) is not importable from here (pytest imports test modules by path), hence a small one.
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
from rlplat_engine_fsdp2.engine import FSDP2Engine, full_tensor

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


BASE = dict(
    model_config=dict(TINY_QWEN2, num_key_value_heads=2),
    seed=7,
    lr=1e-3,
    dtype="float32",
    micro_batch_size_per_gpu=2,
)


def policy_gradient(outputs, micro_batch):
    """Token-mean surrogate ``-sum(advantages * log_probs * mask) / global_token_count``."""
    batch = micro_batch.batch
    return -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"], {}


class EngineHost(Worker):
    """Holds named engines built from ``BASE`` with overrides; every method runs on every rank."""

    def __init__(self):
        super().__init__()
        self.engines: dict[str, FSDP2Engine] = {}

    @register(Dispatch.ONE_TO_ALL)
    def build(self, name: str, overrides: dict) -> None:
        self.engines[name] = FSDP2Engine(BASE, **overrides)
        self.engines[name].init_model()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def forward(self, name: str, batch: DataProto) -> DataProto:
        return self.engines[name].forward(batch)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def train(self, name: str, batch: DataProto) -> dict:
        return self.engines[name].train_batch(without_padding_weight(batch, self.padding_rows), policy_gradient)

    @register(Dispatch.ONE_TO_ALL)
    def parameters(self, name: str) -> dict:
        return {key: tensor.clone() for bucket in self.engines[name].named_weights() for key, tensor in bucket}

    @register(Dispatch.ONE_TO_ALL)
    def gradients(self, name: str) -> dict:
        return {key: full_tensor(parameter.grad) for key, parameter in self.engines[name].module.named_parameters()}

    @register(Dispatch.ONE_TO_ALL)
    def shared_weight_names(self, name: str) -> list[str] | None:
        shared = self.engines[name].shared_weights()
        return None if shared is None else [key for key, _ in shared]


@pytest.fixture(scope="module")
def two_ranks(ray_cluster):
    pool = ResourcePool([2])
    group = RayWorkerGroup(pool, WorkerSpec(EngineHost), role="actor")
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def one_rank():
    group = LocalWorkerGroup(WorkerSpec(EngineHost), role="actor")
    yield group
    group.shutdown()


def spread_batch(rows: int = 12, seed: int = 0) -> DataProto:
    """Prompts of 1-30 tokens left-padded to 30, responses of 1-30 tokens right-padded to 30 (vocab 16,
    as the hosts' model); ``advantages`` standard normal; one optimizer step on the whole batch."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, 31, (rows,), generator=generator)
    response_lengths = torch.randint(1, 31, (rows,), generator=generator)
    columns = torch.arange(30)
    response_valid = columns[None, :] < response_lengths[:, None]
    attention_mask = torch.cat([columns[None, :] >= 30 - prompt_lengths[:, None], response_valid], dim=1).long()
    input_ids = torch.randint(4, 16, attention_mask.shape, generator=generator) * attention_mask
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, 30:],
            "response_mask": response_valid.float(),
            "advantages": torch.randn(rows, 30, generator=generator),
        },
        meta_info={"ppo_mini_batch_size": rows},
    )


PACKED = {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 100}


def test_a_packed_two_rank_step_equals_a_padded_one_rank_step(two_ranks, one_rank):
    batch = spread_batch()
    # AdamW's first step is lr * g / (|g| + eps): on an entry whose gradient rounds to about eps (1e-8 by
    # default), float32 summation-order differences move the update by a sizeable part of lr. eps 1e-6
    # keeps the parameter comparison about the gradient; the gradient itself is compared too.
    two_ranks.build("packed", {**PACKED, "eps": 1e-6})
    one_rank.build("padded", {"eps": 1e-6, "use_remove_padding": False})
    initial = one_rank.parameters("padded")[0]
    packed_metrics = two_ranks.train("packed", batch)[0]
    padded_metrics = one_rank.train("padded", batch)[0]
    gradient_difference = max_difference(two_ranks.gradients("packed")[0], one_rank.gradients("padded")[0])
    after_packed, after_padded = two_ranks.parameters("packed")[0], one_rank.parameters("padded")[0]
    difference = max_difference(after_packed, after_padded)
    print(f"2 ranks packed vs 1 rank padded, max |gradient difference| {gradient_difference:.3g}, "
          f"max |parameter difference| after one step: {difference:.3g}")
    assert gradient_difference <= 1e-6
    assert difference <= 1e-5
    assert max_difference(after_padded, initial) >= 1e-4
    assert packed_metrics["grad_norm"] == pytest.approx(padded_metrics["grad_norm"], rel=1e-5)
    assert packed_metrics["loss"] == pytest.approx(padded_metrics["loss"], rel=1e-5, abs=1e-7)


def test_a_packed_two_rank_forward_equals_a_padded_one_rank_forward(two_ranks, one_rank):
    batch = spread_batch(seed=1)
    two_ranks.build("packed_forward", PACKED)
    one_rank.build("padded_forward", {"use_remove_padding": False})
    valid = batch.batch["response_mask"].bool()
    packed = two_ranks.forward("packed_forward", batch).batch["log_probs"]
    padded = one_rank.forward("padded_forward", batch).batch["log_probs"]
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=0)
    assert torch.count_nonzero(packed[~valid]) == 0


def test_shared_weights_are_none_when_parameters_are_sharded(two_ranks, one_rank):
    two_ranks.build("sharded", {})
    one_rank.build("whole", {})
    assert two_ranks.shared_weight_names("sharded") == [None, None]
    assert "model.embed_tokens.weight" in one_rank.shared_weight_names("whole")[0]
