"""A user's scoring function from reward.custom_function.path / .name."""

import asyncio
import pickle
import textwrap

import pytest

from rlplat.testing import RewardScorerConformance, ScorerCase
from rlplat_rewards.custom import CustomScorer, scorer_from_config

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


def test_the_reward_node_selects_the_custom_function_over_the_named_scorer(user_file):
    scorer = scorer_from_config({"scorer": "math", "custom_function": {"path": str(user_file), "name": "compute_score"}})
    assert isinstance(scorer, CustomScorer)


def test_without_a_custom_function_the_reward_node_names_a_registered_scorer():
    from rlplat_rewards import hendrycks_math

    assert scorer_from_config({"scorer": "math"}) is hendrycks_math.score


def test_a_manager_given_no_scorer_takes_the_custom_function_its_config_names(tmp_path):
    from rlplat import registry

    user_file = tmp_path / "my_reward.py"
    user_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.75\n")
    manager = registry.get("reward_manager", "naive")(None, None, {"custom_function": {"path": str(user_file)}})
    assert isinstance(manager.scorer, CustomScorer) and manager.scorer.path == str(user_file)
