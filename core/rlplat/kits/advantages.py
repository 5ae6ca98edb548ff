"""The advantage-estimator kit: what every estimator of the field needs and a plugin should not write
again (:class:`rlplat.contracts.algorithm.AdvantageEstimator`).

* :func:`check_shapes`: the ``ValueError`` (mentioning "shape") the estimator conformance suite expects
  when the inputs do not describe one [B, R] batch;
* :func:`group_rows`: group id (the prompt's ``uid``) -> its row numbers, in order of first appearance;
* :func:`outcome_advantages`: a per-row score spread over the row's valid tokens, as ``(advantages,
  returns)``.

Whitening over a batch is :func:`rlplat.losses.masked_whiten`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def check_shapes(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
) -> None:
    """Raise a ``ValueError`` (mentioning "shape") unless the inputs describe the same [B, R] batch."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"advantage estimator {name!r}: token_level_rewards has shape {tuple(token_level_rewards.shape)} "
            f"and response_mask has shape {tuple(response_mask.shape)}; both must be the same [B, R]"
        )
    if values is not None and values.shape != token_level_rewards.shape:
        raise ValueError(
            f"advantage estimator {name!r}: values has shape {tuple(values.shape)}, "
            f"token_level_rewards {tuple(token_level_rewards.shape)}; they must match"
        )
    if index is not None and len(index) != token_level_rewards.shape[0]:
        raise ValueError(
            f"advantage estimator {name!r}: index has {len(index)} group ids for "
            f"{token_level_rewards.shape[0]} rows (shape [B] expected)"
        )


def group_rows(index: Any) -> dict[Any, torch.Tensor]:
    """Group id -> the row numbers holding it, in order of first appearance."""
    if index is None:
        raise ValueError("this advantage estimator needs index, the group id (uid) of every row; got None")
    rows: dict[Any, list[int]] = {}
    for row, group in enumerate(np.asarray(index, dtype=object)):
        rows.setdefault(group, []).append(row)
    return {group: torch.tensor(members) for group, members in rows.items()}


def outcome_advantages(per_row: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of an outcome estimator: each row's value on its valid tokens, 0 elsewhere,
    float32; the returns are a copy of the advantages (no critic)."""
    advantages = (per_row.unsqueeze(-1) * response_mask.to(torch.float32)).to(torch.float32)
    return advantages, advantages.clone()
