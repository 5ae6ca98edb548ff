"""MATH (Hendrycks et al., 2021): the last ``\\boxed{...}`` answer, compared after the benchmark's
normalisation (the ``is_equiv`` / ``strip_string`` of its evaluation code, as verl and
lm-evaluation-harness use it): 1.0 when equivalent, else 0.0. The result carries ``acc`` and ``pred``.
"""

from __future__ import annotations

from typing import Any, Mapping


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x`` up to the next ``$``) with its wrapper."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def unbox(boxed: str) -> str | None:
    """The content of ``\\boxed{...}`` / ``\\boxed ...`` / ``\\fbox{...}``; None if it is malformed."""
    for prefix in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix):
            if prefix.endswith("{"):
                return boxed[len(prefix) : -1] if boxed.endswith("}") else None
            return boxed[len(prefix) :]
    return None


def _braced_fractions(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{7}`` -> ``\\frac{1}{7}``."""
    head, *tails = text.split("\\frac")
    rebuilt = head
    for tail in tails:
        rebuilt += "\\frac"
        if not tail:
            raise IndexError("\\frac without arguments")
        if tail.startswith("{"):
            rebuilt += tail
        elif len(tail) < 2:
            return text
        elif tail[1] == "{":
            rebuilt += "{" + tail[0] + "}" + tail[1:]
        else:
            rebuilt += "{" + tail[0] + "}{" + tail[1] + "}" + tail[2:]
    return rebuilt


def _slash_to_fraction(text: str) -> str:
    """``3/4`` (two plain integers) -> ``\\frac{3}{4}``."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return f"\\frac{{{numerator}}}{{{denominator}}}"


def _without_units(text: str) -> str:
    r"""Drop a trailing ``\text{ units}`` (the benchmark writes units that way)."""
    if "\\text{ " in text:
        parts = text.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError(f"ambiguous units in {text!r}")
        return parts[0]
    return text


def _braced_roots(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *tails = text.split("\\sqrt")
    if any(not tail for tail in tails):
        raise IndexError("\\sqrt without an argument")
    return head + "".join("\\sqrt" + (tail if tail.startswith("{") else "{" + tail[:1] + "}" + tail[1:]) for tail in tails)


def normalise(answer: str) -> str:
    """The MATH benchmark's canonical form of an answer string."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "")
    text = _without_units(text)
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 3" -> "3"
        text = sides[1]
    text = _braced_roots(text)
    text = text.replace(" ", "")
    text = _braced_fractions(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_fraction(text)


def is_equivalent(first: str | None, second: str | None) -> bool:
    """Equal after :func:`normalise`; plain equality when normalising fails."""
    if first is None or second is None:
        return first is None and second is None
    try:
        return normalise(first) == normalise(second)
    except (ValueError, IndexError):
        return first == second


def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """1.0 when the last boxed answer of ``solution_str`` is equivalent to ``ground_truth``."""
    boxed = last_boxed(solution_str)
    answer = unbox(boxed) if boxed is not None else None
    correct = answer is not None and is_equivalent(answer, str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": answer or ""}
