"""Conformance suite for judge parsers (kind ``judge_parser``, contract
:class:`rlplat.contracts.reward.JudgeParser`).

A plugin's test provides the built parser and texts with the score each must give (None: no score can
be read, so ``parse`` must raise ``ValueError``)::

    class TestMyParser(JudgeParserConformance):
        @pytest.fixture
        def judge_parser(self):
            return MyParser({"max_score": 5})

        @pytest.fixture
        def judge_parser_cases(self):
            return [JudgeParserCase("Verdict: 4 of 5", 4.0), JudgeParserCase("I cannot judge this.", None)]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest

from rlplat.contracts.reward import JudgeParser

#: What a judge model may write that holds no sensible score; ``parse`` returns a finite score in its
#: range or raises ``ValueError`` on each, never anything else.
GARBAGE = ("", "   ", "\n\n", "-", ".", "...", "NaN", "inf", "-inf", "1e999", "<score></score>", "<score>nan</score>",
           "<score>1e999</score>", "{}", "{score}", "yes no yes no", "\u00e9\u00e8 \U0001f600 \x00", "9" * 400, "Score: " * 500)


@dataclasses.dataclass(frozen=True)
class JudgeParserCase:
    """A judge answer and the score it must give (None: ``parse`` raises ``ValueError``)."""

    text: str
    expected: Optional[float]


def parse_or_failure(parser: JudgeParser, text: str) -> float | None:
    """``parser.parse(text)``, or None when it raised ``ValueError``; any other exception propagates."""
    try:
        return parser.parse(text)
    except ValueError:
        return None


class JudgeParserConformance:
    """Fixtures to provide: ``judge_parser`` (a built parser) and ``judge_parser_cases`` (a list of
    :class:`JudgeParserCase` with at least one readable score and one failure)."""

    def test_is_a_judge_parser(self, judge_parser):
        assert isinstance(judge_parser, JudgeParser)

    def test_cases_cover_a_score_and_a_failure(self, judge_parser_cases):
        expected = [case.expected for case in judge_parser_cases]
        assert any(value is None for value in expected), "judge_parser_cases must hold a text without a readable score"
        assert any(value is not None for value in expected), "judge_parser_cases must hold a text with a readable score"

    def test_cases_parse_as_expected(self, judge_parser, judge_parser_cases):
        for case in judge_parser_cases:
            if case.expected is None:
                with pytest.raises(ValueError):
                    judge_parser.parse(case.text)
            else:
                assert judge_parser.parse(case.text) == pytest.approx(case.expected), case

    def test_a_score_is_a_finite_number(self, judge_parser, judge_parser_cases):
        for case in judge_parser_cases:
            score = parse_or_failure(judge_parser, case.text)
            if score is not None:
                assert isinstance(score, (int, float)) and not isinstance(score, bool), f"{case.text!r} gave {score!r}"
                assert math.isfinite(score), f"{case.text!r} gave {score}"

    def test_is_deterministic(self, judge_parser, judge_parser_cases):
        for case in judge_parser_cases:
            assert parse_or_failure(judge_parser, case.text) == parse_or_failure(judge_parser, case.text)

    @pytest.mark.parametrize("text", GARBAGE, ids=range(len(GARBAGE)))
    def test_any_text_gives_a_finite_score_or_a_value_error(self, judge_parser, text):
        score = parse_or_failure(judge_parser, text)
        assert score is None or (isinstance(score, (int, float)) and math.isfinite(score)), f"{text!r:.60} gave {score!r}"

    def test_its_score_range_is_none_or_a_lower_and_a_higher_bound(self, judge_parser):
        bounds = judge_parser.score_range()
        if bounds is not None:
            low, high = bounds
            assert math.isfinite(low) and math.isfinite(high) and low < high, bounds

    def test_scores_fall_in_the_declared_range(self, judge_parser, judge_parser_cases):
        bounds = judge_parser.score_range()
        if bounds is None:
            pytest.skip("the parser declares no score range")
        for text in [case.text for case in judge_parser_cases] + list(GARBAGE):
            score = parse_or_failure(judge_parser, text)
            assert score is None or bounds[0] <= score <= bounds[1], f"{text!r:.60} gave {score}, outside {bounds}"
