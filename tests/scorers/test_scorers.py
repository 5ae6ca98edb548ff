"""The scorers core owns: a user's function from reward.custom_function.path / .name, the default
exact match, and the choice between them and a registered scorer."""

import asyncio
import pickle
import textwrap

import pytest

from rlplat.testing import RewardScorerConformance, ScorerCase
from rlplat.scorers import CustomScorer, DataSourceScorer, scorer_for

USER_FILE = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}

    async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    def returns_text(data_source, solution_str, ground_truth, extra_info=None):
        return "correct"

    LIMIT = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


class TestCustomScorer(RewardScorerConformance):
    @pytest.fixture
    def scorer(self, user_file):
        return CustomScorer(user_file, "compute_score")

    @pytest.fixture
    def scorer_cases(self):
        return [ScorerCase("mine", " 42 ", "42", None, 1.0), ScorerCase("mine", "41", "42", {"id": 3}, 0.0)]


class TestAsyncCustomScorer(TestCustomScorer):
    @pytest.fixture
    def scorer(self, user_file):
        return CustomScorer(user_file, "compute_score_async")


def test_an_async_function_returns_an_awaitable_checked_score(user_file):
    scorer = CustomScorer(user_file, "compute_score_async")
    assert asyncio.run(scorer("mine", "42", "42", None)) == 1.0


def test_a_missing_file_names_the_config_key_and_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward.custom_function.path.*nowhere.py"):
        CustomScorer(tmp_path / "nowhere.py")


def test_a_missing_function_lists_the_functions_the_file_defines(user_file):
    with pytest.raises(AttributeError, match="reward.custom_function.name.*'score'.*compute_score, compute_score_async"):
        CustomScorer(user_file, "score")


def test_a_name_that_is_not_a_function_is_refused(user_file):
    with pytest.raises(TypeError, match="'LIMIT'.*int"):
        CustomScorer(user_file, "LIMIT")


def test_a_non_numeric_return_names_the_function(user_file):
    scorer = CustomScorer(user_file, "returns_text")
    with pytest.raises(TypeError, match="reward function 'returns_text' from .*my_reward.py"):
        scorer("mine", "42", "42", None)


def test_it_pickles_as_path_and_name_and_reloads(user_file):
    copy = pickle.loads(pickle.dumps(CustomScorer(user_file)))
    assert (copy.path, copy.name) == (str(user_file), "compute_score")
    assert copy("mine", "7", "7", None)["score"] == 1.0


def test_the_custom_function_is_the_scorer_when_no_registered_one_is_named(user_file):
    assert isinstance(scorer_for(None, str(user_file), "compute_score"), CustomScorer)


def test_a_named_scorer_and_a_custom_function_together_are_refused_naming_both(user_file):
    with pytest.raises(ValueError, match=r"reward.scorer='math' and reward.custom_function.path=.*my_reward.py.* both set"):
        scorer_for("math", str(user_file), "compute_score")


def test_a_named_scorer_comes_from_the_registry():
    from rlplat_rewards import hendrycks_math

    assert scorer_for("math", None) is hendrycks_math.score


def test_without_either_each_data_source_goes_to_the_scorer_that_claims_it_else_exact_match():
    scorer = scorer_for(None, None)
    assert isinstance(scorer, DataSourceScorer)
    assert scorer.claims()["openai/gsm8k"] == "gsm8k" and scorer.claims()["lighteval/MATH"] == "math"
    # gsm8k's strict rule wants '#### 46'; exact match would give 0 for this text
    assert scorer("openai/gsm8k", "so the answer is #### 46", "46", None)["score"] == 1.0
    assert scorer("arith", " 46\n", "46", None) == {"score": 1.0, "acc": True}
    assert pickle.loads(pickle.dumps(scorer))("arith", "47", "46", None)["score"] == 0.0


def test_two_scorers_claiming_one_data_source_are_refused_naming_both(register_temporary_plugin):
    from rlplat import hookimpl

    class Claimant:
        @hookimpl
        def register_reward_scorers(self, register):
            register("other_gsm8k", "rlplat.scorers:exact_match", metadata={"data_sources": ["openai/gsm8k"]})

    register_temporary_plugin(Claimant(), name="claimant")
    with pytest.raises(ValueError, match="'openai/gsm8k' is claimed by reward scorers 'gsm8k' and 'other_gsm8k'"):
        scorer_for(None, None)


def test_a_reward_manager_refuses_to_be_built_without_a_scorer():
    from rlplat import registry

    with pytest.raises(TypeError, match="needs a scorer"):
        registry.get("reward_manager", "naive")(None, None, {})
