"""The learning-rate schedule (linear warm-up, then constant or cosine: verl's formulas, as the fsdp2
engine's) and how a mini-batch's rows are grouped into micro-batches (a row count or a token budget)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


@dataclasses.dataclass
class WarmupSchedule:
    """Multiplier of the peak learning rate at optimizer step ``step``: ``step / warmup_steps`` during
    warm-up, then 1 (``constant``) or ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * progress)) / 2``."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def fixed_size_partition(rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    return [list(range(start, min(start + micro_batch_size, rows))) for start in range(0, rows, micro_batch_size)]


def token_budget_partition(weights: Sequence[int], budget: int) -> list[list[int]]:
    """The fewest groups of rows, placed heaviest first into the lightest group, each within ``budget``
    tokens. Deterministic, so every rank of a model replica plans the same groups.
    Raises ``ValueError`` when one row alone exceeds the budget."""
    heaviest = max(weights, default=0)
    if heaviest > budget:
        raise ValueError(f"row {list(weights).index(heaviest)} has {heaviest} tokens, more than max_token_len_per_gpu={budget}")
    parts = max(1, math.ceil(sum(weights) / budget))
    while True:
        groups: list[list[int]] = [[] for _ in range(parts)]
        loads = [0] * parts
        for row in sorted(range(len(weights)), key=lambda row: (-weights[row], row)):
            part = min(range(parts), key=lambda index: (loads[index], index))
            groups[part].append(row)
            loads[part] += weights[row]
        if all(load <= budget for load in loads):
            return [sorted(group) for group in groups if group]
        parts += 1
