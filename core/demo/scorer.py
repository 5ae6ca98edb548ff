"""The demo's reward: 1 for the exact answer, 0 otherwise."""

from __future__ import annotations

from typing import Any


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """``{"score": 1.0, "acc": True}`` when ``solution_str`` is ``ground_truth`` once surrounding whitespace
    is stripped from both, else ``{"score": 0.0, "acc": False}``. No partial credit: the warm-started demo
    model is right often enough for GRPO groups to hold both outcomes."""
    correct = solution_str.strip() == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct}
