"""Loss aggregation: a [B, R] matrix of per-token losses -> one scalar, in the five modes of the field.

With the global normalisers of a mini-batch (valid tokens and sequences summed over every
micro-batch and data-parallel rank, as the engine passes them in ``micro_batch.meta_info``), the
scalar of each micro-batch is its *share* of the mini-batch loss: the sum of the micro-batch
losses equals the loss of the unsplit mini-batch, however it was split. The engine sums gradients,
so every mode is invariant to micro-batching and to the number of ranks.

Numerics follow verl's ``core_algos.agg_loss`` with its data-parallel factor left out (rlplat's
engines sum rather than average gradients over ranks):

``token-mean``
    ``sum(loss * mask) / global_token_count`` (default: the micro-batch's own valid tokens).
``token-sum``
    ``sum(loss * mask)``: no normalisation (verl 0.9's addition).
``seq-mean-token-sum``
    each sequence's token sum, summed, ``/ global_sequence_count``.
``seq-mean-token-mean``
    each sequence's ``token sum / (valid tokens + 1e-8)``, summed, ``/ global_sequence_count``.
``seq-mean-token-sum-norm``
    as ``seq-mean-token-sum``, then ``/ loss_scale_factor`` (default: R, the response width) — Dr. GRPO's
    constant normaliser.

Without global counts the sequence count is that of sequences with at least one valid token (verl's
choice: fully masked rows are not counted). Token counts, and global sequence counts, are clamped to at
least 1, so an all-masked micro-batch or mini-batch gives 0 rather than verl's NaN. To keep invariance exact when some rows are
fully masked, pass as ``global_sequence_count`` the number of rows with a valid token.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

from rlplat.losses.config import LOSS_AGG_MODES



def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero; NaN or inf outside the mask cannot leak in."""
    mask = mask.to(values.dtype)
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum / (mask count + 1e-8)``, verl's definition (0 for an empty mask)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries, with Bessel's correction when ``unbiased`` (verl's default).

    Raises ``ValueError`` when the mask selects fewer than two entries and ``unbiased`` is set.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(
                f"cannot take an unbiased variance over {int(count)} valid token(s); the batch needs at least two"
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with masked mean and unbiased masked variance (verl)."""
    mean, variance = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def at_least_one(count: Any) -> Any:
    """A count used as a divisor, at least 1: a mini-batch without a valid token (every response empty)
    gives a loss of 0 and no gradient instead of NaN."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_token_count: int | float | torch.Tensor | None = None,
    global_sequence_count: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, R] over ``loss_mask`` [B, R]; see the module docstring for the modes.

    Raises ``ValueError`` naming an unknown ``loss_agg_mode``.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        tokens = at_least_one(mask.sum() if global_token_count is None else global_token_count)
        return masked_sum(loss_mat, mask) / tokens
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_sequence = mask.sum(dim=-1)
        sequence_losses = masked_sum(loss_mat, mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            sequence_losses = sequence_losses / (tokens_per_sequence + 1e-8)
        sequence_mask = (tokens_per_sequence > 0).to(loss_mat.dtype)
        sequences = sequence_mask.sum() if global_sequence_count is None else at_least_one(global_sequence_count)
        loss = masked_sum(sequence_losses, sequence_mask) / sequences
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


def global_counts(loss_mask: torch.Tensor) -> dict[str, int]:
    """The normalisers of a whole mini-batch (one rank, before splitting): ``global_token_count`` and
    ``global_sequence_count`` (rows with a valid token), as an engine puts them in ``meta_info``."""
    return {
        "global_token_count": int(loss_mask.sum().item()),
        "global_sequence_count": int((loss_mask.sum(dim=-1) > 0).sum().item()),
    }


def aggregate_with_settings(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, settings: Any) -> torch.Tensor:
    """:func:`aggregate_loss` with the global counts and scale factor a loss config carries
    (``global_token_count``, ``global_sequence_count``, ``loss_scale_factor``); each token's loss is first
    multiplied by its rollout-correction weight when the config carries them (``rollout_is_weights``)."""
    weights = getattr(settings, "rollout_is_weights", None)
    if weights is not None:
        loss_mat = loss_mat * weights.to(loss_mat.dtype)
    return aggregate_loss(
        loss_mat,
        loss_mask,
        loss_agg_mode,
        global_token_count=settings.global_token_count,
        global_sequence_count=settings.global_sequence_count,
        loss_scale_factor=settings.loss_scale_factor,
    )


_DEFERRED_METRICS = contextvars.ContextVar("rlplat_deferred_metrics", default=False)


@contextlib.contextmanager
def deferred_metrics() -> Iterator[None]:
    """Inside, :func:`metric` gives detached 0-dim tensors instead of floats: an engine enters it around its
    micro-batch loop and reads the metrics once after it (``float()``), so no loss makes the host wait for the
    device between micro-batches. Outside (a loss called on its own), metrics are floats, as they always were."""
    token = _DEFERRED_METRICS.set(True)
    try:
        yield
    finally:
        _DEFERRED_METRICS.reset(token)


def metrics_deferred() -> bool:
    """Whether this call runs inside :func:`deferred_metrics`."""
    return _DEFERRED_METRICS.get()


def metric(value: torch.Tensor) -> Any:
    """A loss's metric from a 0-dim tensor: detached, a tensor inside :func:`deferred_metrics`, else ``float``."""
    value = value.detach()
    return value if _DEFERRED_METRICS.get() else float(value)
