"""The actor and critic loss functions report metrics as contributions that sum to the same values
however a mini-batch is split into micro-batches (the engine sums them)."""

from __future__ import annotations

import pytest
import torch

from rlplat.protocol import DataProto
from rlplat.losses.functions import ActorLoss, CriticLoss


def mini_batch() -> DataProto:
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    return DataProto.from_dict({
        "response_mask": mask,
        "old_log_probs": -torch.rand(4, 4, generator=generator),
        "advantages": torch.randn(4, 4, generator=generator),
        "ref_log_prob": -torch.rand(4, 4, generator=generator),
        "values": torch.randn(4, 4, generator=generator),
        "returns": torch.randn(4, 4, generator=generator),
    })


def summed_metrics(loss_fn, batch: DataProto, outputs: dict, parts: list[list[int]]) -> dict[str, float]:
    meta = {"global_token_count": float(batch.batch["response_mask"].sum()), "global_sequence_count": len(batch)}
    totals: dict[str, float] = {}
    for rows in parts:
        micro = batch.select_idxs(rows).with_meta_info(meta)
        _, metrics = loss_fn({key: value[rows] for key, value in outputs.items()}, micro)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_metrics_do_not_depend_on_the_micro_batch_split(mode):
    batch = mini_batch()
    generator = torch.Generator().manual_seed(1)
    outputs = {"log_probs": batch.batch["old_log_probs"] + 0.2 * torch.randn(4, 4, generator=generator),
               "entropy": torch.rand(4, 4, generator=generator)}
    loss_fn = ActorLoss({"loss_agg_mode": mode, "use_kl_loss": True, "entropy_coeff": 0.01})
    whole = summed_metrics(loss_fn, batch, outputs, [[0, 1, 2, 3]])
    split = summed_metrics(loss_fn, batch, outputs, [[0], [1, 2], [3]])
    assert whole.keys() == split.keys()
    for key in whole:
        assert split[key] == pytest.approx(whole[key], abs=1e-6), key


def test_critic_metrics_do_not_depend_on_the_micro_batch_split():
    batch = mini_batch()
    outputs = {"values": batch.batch["values"] + 0.7}
    loss_fn = CriticLoss({"cliprange_value": 0.5})
    whole = summed_metrics(loss_fn, batch, outputs, [[0, 1, 2, 3]])
    split = summed_metrics(loss_fn, batch, outputs, [[0, 3], [1], [2]])
    assert 0 < whole["critic/vf_clipfrac"] < 1
    for key in whole:
        assert split[key] == pytest.approx(whole[key], abs=1e-6), key


@pytest.mark.parametrize("make", [lambda: ActorLoss({"use_kl_loss": True, "entropy_coeff": 0.01}),
                                  lambda: CriticLoss({"cliprange_value": 0.5})], ids=["actor", "critic"])
def test_inside_an_engines_loop_metrics_are_tensors_of_the_same_numbers(make):
    # deferred_metrics(): what an engine enters around its micro-batch loop; the metrics are then 0-dim tensors it
    # reads once after the loop, and float() of each is, to the last bit, the float the loss gives outside it
    from rlplat.losses import deferred_metrics

    batch = mini_batch()
    generator = torch.Generator().manual_seed(2)
    outputs = {"log_probs": batch.batch["old_log_probs"] + 0.2 * torch.randn(4, 4, generator=generator),
               "entropy": torch.rand(4, 4, generator=generator), "values": batch.batch["values"] + 0.7}
    micro = batch.select_idxs([0, 2]).with_meta_info({"global_token_count": 10.0, "global_sequence_count": 4})
    parts = {key: value[[0, 2]] for key, value in outputs.items()}
    _, floats = make()(parts, micro)
    with deferred_metrics():
        _, tensors = make()(parts, micro)
    assert all(isinstance(value, float) for value in floats.values())
    assert floats.keys() == tensors.keys()
    for key, value in tensors.items():
        if isinstance(value, torch.Tensor):
            assert value.dim() == 0 and not value.requires_grad
        assert float(value) == floats[key], key
    assert any(isinstance(value, torch.Tensor) for value in tensors.values())
