"""Loss aggregation: the four modes by hand, and invariance to micro-batches and data-parallel ranks."""

import pytest
import torch

from rlplat.losses.aggregation import LOSS_AGG_MODES, aggregate_loss, global_counts
from rlplat.losses import PolicyLossConfig, ValueLossConfig
from rlplat.losses.functions import ActorLoss, CriticLoss
from rlplat_algorithms.policy_losses import vanilla

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third row is fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),  # valid tokens 1, 2, 4
        ("seq-mean-token-sum", (3 + 4) / 2),  # row sums 3 and 4; the empty row is not counted
        ("seq-mean-token-mean", (1.5 + 4) / 2),  # row means 1.5 and 4
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),  # seq-mean-token-sum divided by R = 3
    ],
)
def test_each_mode_by_hand(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_a_given_scale_factor():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(3.5 / 7)


def test_an_all_masked_micro_batch_gives_zero_not_nan():
    assert aggregate_loss(LOSS, torch.zeros(3, 3), "token-mean").item() == 0.0


def test_unknown_mode_is_named_in_the_error():
    with pytest.raises(ValueError, match="token-median"):
        aggregate_loss(LOSS, MASK, "token-median")


def ragged_batch(rows=8, width=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 4, 3, 5, 2, 6, 3])[:rows]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return torch.randn(rows, width, generator=generator, dtype=torch.float64), mask


# (ranks, micro-batch sizes per rank): one rank split three ways, two ranks of two micro-batches each, ...
SPLITS = [[[8]], [[3, 5]], [[1, 1, 6]], [[2, 2], [2, 2]], [[1, 3], [4]]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("split", SPLITS, ids=lambda split: "-".join("+".join(map(str, rank)) for rank in split))
def test_summing_micro_batch_losses_gives_the_full_batch_loss(mode, split):
    # The engine sums micro-batch losses (gradients) over micro-batches and ranks; with the global
    # normalisers each micro-batch contributes exactly its share of the unsplit loss.
    loss_mat, mask = ragged_batch()
    full = aggregate_loss(loss_mat, mask, mode)
    counts = global_counts(mask)
    total, start = torch.zeros((), dtype=torch.float64), 0
    for rank in split:
        for size in rank:
            part = slice(start, start + size)
            total = total + aggregate_loss(loss_mat[part], mask[part], mode, **counts)
            start += size
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)


class MicroBatch:
    """The two attributes a loss function reads from a DataProto micro-batch."""

    def __init__(self, batch, meta_info):
        self.batch, self.meta_info = batch, meta_info


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_actor_loss_gradients_over_micro_batches_sum_to_the_full_batch_gradient(mode):
    # policy loss + entropy bonus + KL loss, all aggregated with the meta_info counts of the mini-batch
    generator = torch.Generator().manual_seed(1)
    _, mask = ragged_batch()
    old_log_probs = -torch.rand(8, 6, generator=generator, dtype=torch.float64)
    batch = {
        "response_mask": mask,
        "old_log_probs": old_log_probs,
        "advantages": torch.randn(8, 6, generator=generator, dtype=torch.float64),
        "ref_log_prob": old_log_probs + 0.1 * torch.randn(8, 6, generator=generator, dtype=torch.float64),
    }
    log_probs = (old_log_probs + 0.2 * torch.randn(8, 6, generator=generator, dtype=torch.float64)).requires_grad_()
    entropy = torch.rand(8, 6, generator=generator, dtype=torch.float64)
    config = PolicyLossConfig(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, clip_ratio_high=0.28)
    loss_fn = ActorLoss(config, policy_loss=vanilla)

    full_loss, _ = loss_fn({"log_probs": log_probs, "entropy": entropy}, MicroBatch(batch, {}))
    (full_gradient,) = torch.autograd.grad(full_loss, log_probs)

    meta_info = global_counts(mask)
    summed = torch.zeros_like(log_probs)
    for part in (slice(0, 3), slice(3, 4), slice(4, 8)):
        micro = MicroBatch({key: value[part] for key, value in batch.items()}, meta_info)
        loss, _ = loss_fn({"log_probs": log_probs[part], "entropy": entropy[part]}, micro)
        summed = summed + torch.autograd.grad(loss, log_probs)[0]
    torch.testing.assert_close(summed, full_gradient, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_critic_loss_over_micro_batches_sums_to_the_full_batch_loss(mode):
    generator = torch.Generator().manual_seed(2)
    _, mask = ragged_batch()
    batch = {
        "response_mask": mask,
        "values": torch.randn(8, 6, generator=generator, dtype=torch.float64),
        "returns": torch.randn(8, 6, generator=generator, dtype=torch.float64),
    }
    vpreds = batch["values"] + 0.6 * torch.randn(8, 6, generator=generator, dtype=torch.float64)
    loss_fn = CriticLoss(ValueLossConfig(loss_agg_mode=mode, cliprange_value=0.3))
    full, _ = loss_fn({"values": vpreds}, MicroBatch(batch, {}))
    meta_info = global_counts(mask)
    parts = [slice(0, 5), slice(5, 8)]
    total = sum(
        loss_fn({"values": vpreds[part]}, MicroBatch({k: v[part] for k, v in batch.items()}, meta_info))[0]
        for part in parts
    )
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_mini_batch_without_a_valid_token_gives_zero_not_nan(mode):
    loss_mat = torch.tensor([[2.0, 3.0]], requires_grad=True)
    loss = aggregate_loss(loss_mat, torch.zeros(1, 2), mode, global_token_count=0, global_sequence_count=0)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(loss_mat.grad, torch.zeros(1, 2))
