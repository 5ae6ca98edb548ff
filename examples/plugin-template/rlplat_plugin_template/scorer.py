"""The scorer itself: ``score(data_source, solution_str, ground_truth, extra_info) -> float``."""

from __future__ import annotations

from typing import Any, Mapping


def normalise(text: str) -> str:
    return " ".join(str(text).split()).casefold()


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when ``solution_str`` equals ``ground_truth`` after collapsing whitespace and case, else 0.0."""
    return 1.0 if normalise(solution_str) == normalise(ground_truth) else 0.0
