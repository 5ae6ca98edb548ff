"""Conformance suite for reward scorers (kind ``reward_scorer``)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import pickle
from typing import Any, Mapping

import pytest

from rlplat.contracts.reward import split_score
from rlplat.testing.api_levels import implementation_api, skip_unless_asked


@dataclasses.dataclass(frozen=True)
class ScorerCase:
    """One input and the score it must get."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Mapping[str, Any] | None
    expected_score: float


def call_scorer(scorer, case: ScorerCase, **overrides: Any):
    arguments = dict(
        data_source=case.data_source,
        solution_str=case.solution_str,
        ground_truth=case.ground_truth,
        extra_info=case.extra_info,
    )
    arguments.update(overrides)
    result = scorer(**arguments)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable):
    return await awaitable


class RewardScorerConformance:
    """Fixtures to provide: ``scorer`` (the callable) and ``scorer_cases`` (a list of :class:`ScorerCase`
    with at least one rewarded and one unrewarded answer). Optional: ``registered_name`` (the name the
    plugin registers it under, checked against the process-wide registry), ``plugin_api`` (the plugin API
    range it is written for; found from its plugin by default, see :mod:`rlplat.testing.api_levels`)."""

    @pytest.fixture
    def registered_name(self) -> str | None:
        return None

    @pytest.fixture
    def plugin_api(self, scorer, registered_name) -> str | None:
        return implementation_api(scorer, "reward_scorer", registered_name)

    def test_cases_score_as_expected(self, scorer, scorer_cases):
        for case in scorer_cases:
            score, _ = split_score(call_scorer(scorer, case))
            assert score == pytest.approx(case.expected_score), case

    def test_cases_cover_a_reward_and_a_miss(self, scorer_cases):
        expected = {case.expected_score for case in scorer_cases}
        assert len(expected) >= 2, "scorer_cases must hold at least two different expected scores"

    def test_result_is_a_number_or_a_dict_with_a_numeric_score(self, scorer, scorer_cases):
        for case in scorer_cases:
            result = call_scorer(scorer, case)
            assert isinstance(result, (int, float, Mapping)) or hasattr(result, "__float__"), type(result)
            split_score(result)

    def test_is_deterministic(self, scorer, scorer_cases):
        for case in scorer_cases:
            assert split_score(call_scorer(scorer, case)) == split_score(call_scorer(scorer, case))

    def test_empty_response_gets_a_score(self, scorer, scorer_cases):
        split_score(call_scorer(scorer, scorer_cases[0], solution_str=""))

    def test_accepts_missing_extra_info(self, scorer, scorer_cases):
        split_score(call_scorer(scorer, scorer_cases[0], extra_info=None))

    def test_does_not_modify_its_inputs(self, scorer, scorer_cases):
        for case in scorer_cases:
            before = copy.deepcopy(case)
            call_scorer(scorer, case)
            assert case == before

    def test_is_picklable(self, scorer):
        assert pickle.loads(pickle.dumps(scorer)) is not None

    def test_a_pickled_copy_scores_as_the_original(self, scorer, scorer_cases, plugin_api):
        # reward workers receive the scorer pickled: the copy must be the same function
        skip_unless_asked(plugin_api, "1.1", "a pickled copy scoring as the original")
        copy = pickle.loads(pickle.dumps(scorer))
        for case in scorer_cases:
            assert split_score(call_scorer(copy, case)) == split_score(call_scorer(scorer, case))

    def test_registered_name_resolves_to_the_scorer(self, scorer, registered_name):
        if registered_name is None:
            pytest.skip("the subclass names no registered_name")
        from rlplat import registry

        assert registry.get("reward_scorer", registered_name) is scorer
