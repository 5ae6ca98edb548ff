"""The supervised fine-tuning loss: negative log-likelihood of the target tokens, one micro-batch at a time.

:class:`NLLLoss` is a :class:`rlplat.contracts.engine.LossFunction`, so any engine's ``train_batch``
trains it unchanged. The engine's ``log_probs`` [b, R] are the log-probabilities of the ``responses``
tokens; ``response_mask`` [b, R] marks the tokens that carry loss (an SFT batch sets it to the assistant
tokens, :mod:`rlplat_sft.data`). The loss is aggregated by ``loss_agg_mode`` with the mini-batch's
global counts from ``meta_info`` (:func:`rlplat.losses.aggregate_loss`), so the micro-batch losses sum
to the loss of the unsplit mini-batch on any number of ranks. ``token-mean`` (the default) is the mean
NLL per target token, what Hugging Face's ``labels`` loss and TRL's ``SFTTrainer`` compute.

Metrics (contributions, summed by the engine): ``sft/loss`` (the aggregated loss), ``sft/nll_sum``
(summed NLL of the micro-batch's target tokens) and ``sft/tokens`` (their count): the mini-batch's
per-token NLL is ``sft/nll_sum / sft/tokens`` whatever the aggregation mode.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlplat.losses.aggregation import aggregate_loss, masked_sum, metric
from rlplat.losses.config import LOSS_AGG_MODES


def nll_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             global_token_count: Any = None, global_sequence_count: Any = None) -> torch.Tensor:
    """``-log_probs`` aggregated over ``loss_mask`` by ``loss_agg_mode`` (:func:`rlplat.losses.aggregate_loss`)."""
    return aggregate_loss(-log_probs, loss_mask, loss_agg_mode, global_token_count=global_token_count,
                          global_sequence_count=global_sequence_count)


class NLLLoss:
    """Negative log-likelihood of the tokens under ``response_mask`` (see the module docstring).

    Reads ``response_mask`` from the micro-batch and ``log_probs`` from the engine's outputs; picklable,
    so the driver may build it and ship it to the workers."""

    needs_entropy = False

    def __init__(self, loss_agg_mode: str = "token-mean"):
        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
        self.loss_agg_mode = loss_agg_mode

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch.batch["response_mask"]
        log_probs = outputs["log_probs"]
        meta = micro_batch.meta_info
        loss = nll_loss(log_probs, mask, self.loss_agg_mode, global_token_count=meta.get("global_token_count"),
                        global_sequence_count=meta.get("global_sequence_count"))
        nll_sum = masked_sum(-log_probs.detach(), mask.to(log_probs.device))
        return loss, {"sft/loss": metric(loss), "sft/nll_sum": metric(nll_sum), "sft/tokens": metric(mask.sum().double())}

    def __repr__(self) -> str:
        return f"NLLLoss(loss_agg_mode={self.loss_agg_mode!r})"
