import pytest

from rlplat.testing import AlgorithmConformance
from rlplat_plugin_template.specs import median_reinforce


class TestMedianReinforce(AlgorithmConformance):
    """Runs where the plugin is installed: the suite looks its estimator and loss up in the registry."""

    @pytest.fixture
    def algorithm(self):
        return median_reinforce()

    @pytest.fixture
    def registered_name(self):
        return "example_median_reinforce"


def test_uses_this_plugins_estimator_and_loss_and_builds_no_reference_or_critic():
    algorithm = median_reinforce()
    nodes = algorithm.default_nodes()
    assert (algorithm.adv_estimator, algorithm.policy_loss) == ("example_group_median", "example_truncated_is")
    assert nodes["actor"]["loss"]["policy_loss"] == {"loss_mode": "example_truncated_is"}
    assert not algorithm.needs_critic and not algorithm.uses_reference(nodes["actor"]["loss"], nodes["algorithm"])
