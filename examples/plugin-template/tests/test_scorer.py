import pytest

from rlplat.testing import RewardScorerConformance, ScorerCase
from rlplat_plugin_template.scorer import exact_match


class TestExactMatch(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return exact_match

    @pytest.fixture
    def registered_name(self):
        return "example_exact_match"

    @pytest.fixture
    def scorer_cases(self):
        return [
            ScorerCase("demo", "Paris", "paris", None, 1.0),
            ScorerCase("demo", "  New   York ", "new york", {"split": "test"}, 1.0),
            ScorerCase("demo", "Lyon", "paris", None, 0.0),
        ]
