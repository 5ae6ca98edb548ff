"""The gsm8k and math scorers: conformance suites and their extraction and equivalence rules."""

import pytest

from rlplat import registry
from rlplat.testing import RewardScorerConformance, ScorerCase
from rlplat_rewards import gsm8k, hendrycks_math


class TestGsm8kStrict(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return gsm8k.score

    @pytest.fixture
    def registered_name(self):
        return "gsm8k"

    @pytest.fixture
    def scorer_cases(self):
        return [
            ScorerCase("openai/gsm8k", "She has 3 + 4 = 7 apples.\n#### 7", "7", None, 1.0),
            ScorerCase("openai/gsm8k", "The total is #### $1,234", "1234", {"split": "test"}, 1.0),
            ScorerCase("openai/gsm8k", "The answer is 7", "7", None, 0.0),  # no '#### ' marker
            ScorerCase("openai/gsm8k", "#### 8", "7", None, 0.0),
        ]


class TestGsm8kFlexible(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return gsm8k.score_flexible

    @pytest.fixture
    def registered_name(self):
        return "gsm8k_flexible"

    @pytest.fixture
    def scorer_cases(self):
        return [
            ScorerCase("openai/gsm8k", "3 + 4 makes 7", "7", None, 1.0),
            ScorerCase("openai/gsm8k", "so she pays $1,234.", "1234", None, 1.0),
            ScorerCase("openai/gsm8k", "7 apples, then 2 more: 9", "7", None, 0.0),  # the last number counts
        ]


class TestMath(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return hendrycks_math.score

    @pytest.fixture
    def registered_name(self):
        return "math"

    @pytest.fixture
    def scorer_cases(self):
        return [
            ScorerCase("lighteval/MATH", "so the answer is $\\boxed{\\frac12}$.", "\\frac{1}{2}", None, 1.0),
            ScorerCase("lighteval/MATH", "first \\boxed{3}, no: \\boxed{4}", "4", None, 1.0),
            ScorerCase("lighteval/MATH", "\\boxed{5}", "4", None, 0.0),
            ScorerCase("lighteval/MATH", "no box, 4", "4", None, 0.0),
        ]


def test_gsm8k_strict_takes_the_last_marked_answer_and_reports_it():
    result = gsm8k.score("gsm8k", "#### 3\nactually\n#### 4", "4")
    assert result == {"score": 1.0, "acc": True, "pred": "4"}


def test_gsm8k_strips_commas_and_dollars_on_both_sides():
    assert gsm8k.score("gsm8k", "#### $12,000", "12,000")["score"] == 1.0


def test_gsm8k_flexible_skips_a_lone_period():
    assert gsm8k.extract_answer("it costs 5 dollars.", "flexible") == "5"


def test_gsm8k_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="flexible"):
        gsm8k.extract_answer("#### 4", "lenient")


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("\\dfrac{3}{4}", "\\frac34"),  # dfrac and unbraced fractions
        ("3/4", "\\frac{3}{4}"),  # a slash between two integers
        ("0.5", "\\frac{1}{2}"),
        (".5", "\\frac12"),  # a leading period gets its zero
        ("x = 3", "3"),  # a short left-hand side is dropped
        ("\\left( 1, 2 \\right)", "(1,2)"),  # \left, \right and spaces
        ("90^\\circ", "90"),
        ("5\\%", "5"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("10 \\text{ cm}", "10"),  # units after \text{ are removed
    ],
)
def test_math_normalisation_makes_these_equivalent(answer, truth):
    assert hendrycks_math.is_equivalent(answer, truth)


@pytest.mark.parametrize(("answer", "truth"), [("3", "4"), ("\\frac{1}{3}", "0.33"), ("x+1", "x-1")])
def test_math_normalisation_keeps_these_apart(answer, truth):
    assert not hendrycks_math.is_equivalent(answer, truth)


def test_math_reads_fbox_and_the_space_form_of_boxed():
    assert hendrycks_math.score("math", "\\fbox{7}", "7")["score"] == 1.0
    assert hendrycks_math.score("math", "$\\boxed 7$", "7")["score"] == 1.0


def test_math_scores_an_unclosed_box_zero():
    assert hendrycks_math.score("math", "\\boxed{7", "7") == {"score": 0.0, "acc": False, "pred": ""}


def test_every_scorer_is_listed():
    assert {"gsm8k", "gsm8k_flexible", "math"} <= set(registry.names("reward_scorer"))
