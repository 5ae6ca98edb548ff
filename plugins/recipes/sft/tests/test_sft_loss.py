"""rlplat-sft's loss (:class:`rlplat_sft.loss.NLLLoss`, what ``rlplat sft`` trains with): the mean
NLL of the mini-batch's trained tokens however its micro-batches split it, and the aggregation modes it takes."""

from __future__ import annotations

import pytest
import torch

from rlplat.protocol import DataProto


def test_nll_loss_is_the_mean_over_the_mini_batch_tokens_however_it_is_split():
    from rlplat_sft.loss import NLLLoss

    log_probs = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -8.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    loss_fn = NLLLoss()
    whole, metrics = loss_fn({"log_probs": log_probs}, DataProto.from_dict({"response_mask": mask}))
    assert whole.item() == pytest.approx((1 + 2 + 0.5 + 3) / 4)
    assert (metrics["sft/nll_sum"], metrics["sft/tokens"]) == (6.5, 4.0)
    counts = {"global_token_count": 4, "global_sequence_count": 2}
    parts = [loss_fn({"log_probs": log_probs[row:row + 1]}, DataProto.from_dict({"response_mask": mask[row:row + 1]}, meta_info=counts))[0]
             for row in range(2)]
    assert sum(parts).item() == pytest.approx(whole.item())


def test_nll_loss_refuses_an_unknown_aggregation_mode():
    from rlplat_sft.loss import NLLLoss

    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token-avg'"):
        NLLLoss("token-avg")
