"""GSM8K: the answer is the number after ``#### `` (strict) or the last number in the response (flexible).

As verl's ``gsm8k`` scorer (correct: 1.0, anything else: 0.0; strict mode by default), with these
normalisations applied to the extracted answer and to the ground truth alike: thousands separators
(``,``) and ``$`` are removed (``#### $1,234`` is ``1234``), and a trailing period that ends the
sentence is dropped (``... is 72.`` gives ``72``; verl compares ``72.`` and misses it). The result
carries ``acc`` (bool) and ``pred`` (the normalised answer, ``""`` when none was found).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

STRICT_ANSWER = re.compile(r"#### \$?(-?[0-9.,]+)")
ANY_NUMBER = re.compile(r"(-?[0-9.,]+)")


def normalise_number(text: str) -> str:
    """``"$1,234."`` -> ``"1234"``."""
    return str(text).strip().replace(",", "").replace("$", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The normalised answer: the last ``#### <number>`` (strict) or the last number (flexible)."""
    if method == "strict":
        found = STRICT_ANSWER.findall(solution_str)
    elif method == "flexible":
        found = ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    for candidate in reversed(found):
        answer = normalise_number(candidate)
        if answer not in ("", "-"):
            return answer
    return None


def _score(solution_str: str, ground_truth: Any, method: str) -> dict[str, Any]:
    answer = extract_answer(solution_str, method)
    correct = answer is not None and answer == normalise_number(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": answer or ""}


def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Strict GSM8K: 1.0 when the last ``#### <number>`` equals the ground truth."""
    return _score(solution_str, ground_truth, "strict")


def score_flexible(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Flexible GSM8K: 1.0 when the last number in the response equals the ground truth."""
    return _score(solution_str, ground_truth, "flexible")
