"""RewardManagerConformance passes a correct manager and catches a broken one.

The suite runs in a fresh interpreter (torch cannot be imported twice in one process), on a test
module written as a plugin author would write it.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

SUITE = """
    import pytest
    import torch
    from rlplat.contracts.reward import RewardManager
    from rlplat.protocol import DataProto
    from rlplat.testing import RewardManagerConformance, reward_batch, word_tokenizer
    from rlplat_rewards.gsm8k import score
    from rlplat_rewards.managers import NaiveRewardManager


    class Broken(RewardManager):
        def __init__(self, scorer, tokenizer, config=None):
            self.calls = 0

        def __call__(self, batch):
            self.calls += 1
            batch.batch["response_mask"][:, -1] = 0            # modifies its input
            scores = torch.zeros(batch.batch["responses"].shape)
            scores[:, 0] = self.calls                           # first token, and not deterministic
            return DataProto.from_dict(tensors={"token_level_scores": scores}, meta_info={"reward_metrics": {}})


    class TestManager(RewardManagerConformance):
        @pytest.fixture
        def tokenizer(self):
            return word_tokenizer(["####", "4", "5"])

        @pytest.fixture
        def reward_manager(self, tokenizer):
            return IMPLEMENTATION(score, tokenizer, {})

        @pytest.fixture
        def reward_batch(self, tokenizer):
            return reward_batch(tokenizer, ["#### 4", "#### 5 5"], ground_truths=["4", "4"])

        @pytest.fixture
        def expected_scores(self):
            return [1.0, 0.0]
"""


def run_suite(tmp_path, implementation):
    test_file = tmp_path / f"test_{implementation.lower()}_manager.py"
    test_file.write_text(textwrap.dedent(SUITE.replace("IMPLEMENTATION", implementation)))
    environment = {k: v for k, v in os.environ.items() if k not in ("RLPLAT_PLUGINS", "RLPLAT_DISABLE_PLUGIN_AUTOLOAD")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(test_file)],
        capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300,
    )
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", result.stdout)}
    return result, counts


@pytest.mark.slow
def test_a_correct_manager_passes(tmp_path):
    result, counts = run_suite(tmp_path, "NaiveRewardManager")
    assert counts == {"passed": 9}, result.stdout + result.stderr


@pytest.mark.slow
def test_a_broken_manager_fails_the_checks_it_breaks(tmp_path):
    result, counts = run_suite(tmp_path, "Broken")
    assert counts == {"passed": 3, "failed": 6}, result.stdout + result.stderr
    for name in (
        "test_scores_sit_on_the_last_valid_response_token_only",
        "test_scores_match_the_expected_ones",
        "test_reward_metrics_are_floats",
        "test_does_not_modify_its_input",
        "test_is_deterministic",
        "test_permuting_rows_permutes_the_scores",
    ):
        assert f"FAILED {name}" in result.stdout.replace("test_broken_manager.py::TestManager::", ""), name
