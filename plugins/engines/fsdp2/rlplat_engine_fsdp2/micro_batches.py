"""How a mini-batch's rows are grouped into micro-batches: a fixed row count, or a token budget with a
balanced partition (greedy longest-processing-time first).

These functions only plan (lists of row indices); the engine agrees the count with the other ranks,
because FSDP2's collectives need every rank to run the same number of forwards and backwards, and
fills a rank that has fewer with empty micro-batches (run on a stand-in row, contributing nothing).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def fixed_size_partition(rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    return [list(range(start, min(start + micro_batch_size, rows))) for start in range(0, rows, micro_batch_size)]


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """``parts`` groups of row indices whose weight sums are close: each row, heaviest first, goes to the
    lightest group so far (ties broken by group index, so the result is deterministic).

    Each group lists its rows in ascending order and groups are ordered by their first row; with more
    groups than rows the surplus groups are empty and come last.
    """
    if parts < 1:
        raise ValueError(f"balanced_partition needs at least one part, got {parts}")
    order = sorted(range(len(weights)), key=lambda row: (-weights[row], row))
    heap = [(0, 0, part) for part in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for row in order:
        load, count, part = heapq.heappop(heap)
        groups[part].append(row)
        heapq.heappush(heap, (load + weights[row], count + 1, part))
    filled = sorted((sorted(group) for group in groups if group), key=lambda group: group[0])
    return filled + [[] for _ in range(parts - len(filled))]


def token_budget_partition(weights: Sequence[int], budget: int, min_parts: int = 1) -> list[list[int]]:
    """The fewest balanced groups (at least ``min_parts``) whose weight sums each fit in ``budget``.

    Raises ``ValueError`` when one row alone exceeds the budget.
    """
    heaviest = max(weights, default=0)
    if heaviest > budget:
        row = list(weights).index(heaviest)
        raise ValueError(
            f"row {row} has {heaviest} tokens, more than max_token_len_per_gpu={budget}; raise the budget "
            "to at least the longest sequence (prompt + response)"
        )
    parts = max(min_parts, math.ceil(sum(weights) / budget), 1)
    while True:
        groups = balanced_partition(weights, parts)
        if all(sum(weights[row] for row in group) <= budget for group in groups):
            return groups
        parts += 1
