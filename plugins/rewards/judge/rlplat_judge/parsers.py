"""rlplat's judge parsers (kind ``judge_parser``): how the ``judge`` reward manager reads a score from the
text a judge model wrote. Each is built from its ``reward.config.parser_config`` node.

``number``
    The last (or first) number in the text, e.g. ``"I would rate it 7."`` -> 7.0. ``"7/10"`` reads 10 (the
    last number): for such answers set ``position: first`` or ask for a tag.
``tagged``
    The number inside ``<score>...</score>`` (or the one group of a configured regular expression), the
    last such tag by default: a judge asked for a tag may reason in free text before it.
``yes_no``
    A verdict word: ``yes`` -> 1.0, ``no`` -> 0.0 (words and scores configurable), the first one by default.

``number`` and ``tagged`` take an optional ``[min_score, max_score]`` range: a score outside it is a
parse failure, and the range is what ``reward.config.normalize`` maps onto [0, 1].
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, List, Literal, Optional

from rlplat.config_node import read_config_node
from rlplat.contracts.reward import JudgeParser

#: A decimal number written as models write them: an optional minus sign (not when it joins two numbers,
#: as in ``5-3``), digits with an optional fraction, or a bare fraction (``.5``).
NUMBER = re.compile(r"(?<![\d.])-?(?:\d+(?:\.\d+)?|\.\d+)")


@dataclasses.dataclass
class RangeConfig:
    """An optional range every score must fall in."""

    min_score: Optional[float] = None
    """Lowest acceptable score (None: no bound); a lower one is a parse failure."""
    max_score: Optional[float] = None
    """Highest acceptable score (None: no bound); a higher one is a parse failure."""

    def __post_init__(self) -> None:
        if self.min_score is not None and self.max_score is not None and not self.min_score < self.max_score:
            raise ValueError(f"min_score ({self.min_score}) must be below max_score ({self.max_score})")

    def check(self, score: float, text: str) -> float:
        """``score`` when it is finite and in range; ``ValueError`` quoting ``text`` otherwise."""
        if not math.isfinite(score):
            raise ValueError(f"the score {score} read from {text!r:.200} is not finite")
        if (self.min_score is not None and score < self.min_score) or (self.max_score is not None and score > self.max_score):
            raise ValueError(f"the score {score:g} read from {text!r:.200} is outside [{self.min_score}, {self.max_score}]")
        return score

    def bounds(self) -> tuple[float, float] | None:
        if self.min_score is None or self.max_score is None:
            return None
        return (self.min_score, self.max_score)


@dataclasses.dataclass
class NumberParserConfig(RangeConfig):
    """``reward.config.parser_config`` of the ``number`` parser."""

    position: Literal["last", "first"] = "last"
    """Which number of the text is the score."""


@dataclasses.dataclass
class TaggedParserConfig(RangeConfig):
    """``reward.config.parser_config`` of the ``tagged`` parser."""

    pattern: str = r"<score>\s*(-?(?:\d+(?:\.\d+)?|\.\d+))\s*</score>"
    """Regular expression with exactly one group, which captures the score (searched with ``re.DOTALL``)."""
    position: Literal["last", "first"] = "last"
    """Which match of the text holds the score."""

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            compiled = re.compile(self.pattern, re.DOTALL)
        except re.error as error:
            raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {error}") from None
        if compiled.groups != 1:
            raise ValueError(f"pattern {self.pattern!r} must have exactly one group (the score), it has {compiled.groups}")


@dataclasses.dataclass
class YesNoParserConfig:
    """``reward.config.parser_config`` of the ``yes_no`` parser."""

    yes: List[str] = dataclasses.field(default_factory=lambda: ["yes"])
    """Words that mean yes (whole words, any case)."""
    no: List[str] = dataclasses.field(default_factory=lambda: ["no"])
    """Words that mean no (whole words, any case)."""
    yes_score: float = 1.0
    """Score of a yes."""
    no_score: float = 0.0
    """Score of a no."""
    position: Literal["first", "last"] = "first"
    """Which verdict word of the text counts (a judge that reasons first: ``last``)."""

    def __post_init__(self) -> None:
        if not self.yes or not self.no:
            raise ValueError("yes and no each need at least one word")
        words = [word.strip().lower() for word in (*self.yes, *self.no)]
        if not all(words):
            raise ValueError("yes and no words must not be empty")
        shared = sorted(set(w.strip().lower() for w in self.yes) & set(w.strip().lower() for w in self.no))
        if shared:
            raise ValueError(f"{shared} are both yes and no words")
        if self.yes_score == self.no_score:
            raise ValueError(f"yes_score and no_score are both {self.yes_score}: the verdict would not matter")


def pick(matches: list[Any], position: str) -> Any:
    return matches[-1] if position == "last" else matches[0]


class NumberParser(JudgeParser):
    """See the module docstring (``number``)."""

    def __init__(self, config: Any = None):
        super().__init__(read_config_node(config, NumberParserConfig, "reward.config.parser_config"))

    def parse(self, text: str) -> float:
        numbers = NUMBER.findall(text)
        if not numbers:
            raise ValueError(f"no number in the judge's answer {text!r:.200}")
        return self.config.check(float(pick(numbers, self.config.position)), text)

    def score_range(self) -> tuple[float, float] | None:
        return self.config.bounds()


class TaggedParser(JudgeParser):
    """See the module docstring (``tagged``)."""

    def __init__(self, config: Any = None):
        super().__init__(read_config_node(config, TaggedParserConfig, "reward.config.parser_config"))
        self.pattern = re.compile(self.config.pattern, re.DOTALL)

    def parse(self, text: str) -> float:
        found = self.pattern.findall(text)
        if not found:
            raise ValueError(f"no match of {self.config.pattern!r} in the judge's answer {text!r:.200}")
        captured = pick(found, self.config.position).strip()
        try:
            score = float(captured)
        except ValueError:
            raise ValueError(f"{captured!r:.80} (matched by {self.config.pattern!r}) is not a number") from None
        return self.config.check(score, text)

    def score_range(self) -> tuple[float, float] | None:
        return self.config.bounds()


class YesNoParser(JudgeParser):
    """See the module docstring (``yes_no``)."""

    def __init__(self, config: Any = None):
        super().__init__(read_config_node(config, YesNoParserConfig, "reward.config.parser_config"))
        words = {word.strip().lower(): self.config.yes_score for word in self.config.yes}
        words.update({word.strip().lower(): self.config.no_score for word in self.config.no})
        self.scores = words
        alternatives = "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True))
        self.pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)

    def parse(self, text: str) -> float:
        found = self.pattern.findall(text)
        if not found:
            raise ValueError(f"no verdict ({', '.join(sorted(self.scores))}) in the judge's answer {text!r:.200}")
        return self.scores[pick(found, self.config.position).lower()]

    def score_range(self) -> tuple[float, float] | None:
        return (min(self.config.yes_score, self.config.no_score), max(self.config.yes_score, self.config.no_score))
