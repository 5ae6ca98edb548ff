"""What reward managers, scoring roles and the trainer share about where a response's score goes."""

from __future__ import annotations

from typing import Any


def last_tokens(response_mask: Any) -> list[int]:
    """Per row, the index of the last response token with mask 1 (where a sequence's score goes), or -1
    for a row without any."""
    import torch

    mask = torch.as_tensor(response_mask)
    width = mask.shape[1]
    positions = torch.arange(width).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values
    return [int(value) for value in last.tolist()]
