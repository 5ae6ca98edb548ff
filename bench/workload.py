"""The batch every benchmark moves: 1024 rows of 2048 tokens, as a rollout step would hand them over."""

from __future__ import annotations

import numpy as np
import torch

ROWS = 1024
SEQUENCE_LENGTH = 2048
RESPONSE_LENGTH = 1024


def batch_columns(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """``(tensors, non_tensors)``: int64 ``input_ids``, ``attention_mask``, ``position_ids`` of
    1024 x 2048, float32 ``old_log_probs`` of 1024 x 1024 (about 52 MiB in all), and an object ``uid``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 32_000, (ROWS, SEQUENCE_LENGTH), dtype=torch.int64, generator=generator)
    prompt_lengths = torch.randint(1, SEQUENCE_LENGTH, (ROWS, 1), generator=generator)
    attention_mask = (torch.arange(SEQUENCE_LENGTH).expand(ROWS, -1) >= SEQUENCE_LENGTH - prompt_lengths).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    old_log_probs = -torch.rand((ROWS, RESPONSE_LENGTH), dtype=torch.float32, generator=generator) * 5
    uid = np.array([f"prompt-{row // 8:05d}" for row in range(ROWS)], dtype=object)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "old_log_probs": old_log_probs,
    }
    return tensors, {"uid": uid}


def payload_mib(tensors: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
