"""Test kits for plugin authors: conformance suites (one per kind) and pytest fixtures.

A plugin's tests subclass a suite and provide its factory fixture::

    from rlplat.testing import RewardScorerConformance, ScorerCase

    class TestMyScorer(RewardScorerConformance):
        @pytest.fixture
        def scorer(self):
            return my_package.score

        @pytest.fixture
        def scorer_cases(self):
            return [ScorerCase("my_task", "42", "42", None, 1.0), ScorerCase("my_task", "7", "42", None, 0.0)]

A suite asks of an implementation what the plugin API version its plugin declares asked
(``RLPLAT_PLUGIN_API``; API 1.0's requirements when it declares none); its ``plugin_api`` fixture finds the
declaration and a test class may override it (:mod:`rlplat.testing.api_levels`). A requirement added later
is skipped, with the reason.

The fixtures of :mod:`rlplat.testing.pytest_plugin` (``register_temporary_plugin``,
``isolated_registry``, ``cli_run`` and ``cli_in_process`` for running the ``rlplat`` command,
``scripted_policy``) reach every repository that installs rlplat, through a ``pytest11`` entry point.
Suites for kinds that need torch import it only when their module is imported.
"""

from __future__ import annotations

from rlplat.lazy_names import lazy_names


_LAZY_NAMES = {
    "RewardScorerConformance": "rlplat.testing.scorers",
    "fit_run": "rlplat.testing.runs",
    "AgentLoopConformance": "rlplat.testing.agents",
    "ToolConformance": "rlplat.testing.agents",
    "ToolCase": "rlplat.testing.agents",
    "ToolCallParserConformance": "rlplat.testing.agents",
    "EnvironmentConformance": "rlplat.testing.agents",
    "EnvironmentCase": "rlplat.testing.agents",
    "ScriptedClient": "rlplat.testing.agents",
    "ScriptedPolicy": "rlplat.testing.agents",
    "ScorerCase": "rlplat.testing.scorers",
    "AdvantageEstimatorConformance": "rlplat.testing.estimators",
    "PolicyLossConformance": "rlplat.testing.losses",
    "AlgorithmConformance": "rlplat.testing.algorithms",
    "RoleConformance": "rlplat.testing.roles",
    "StepObserverConformance": "rlplat.testing.observers",
    "CommandConformance": "rlplat.testing.commands",
    "RolloutEngineConformance": "rlplat.testing.rollouts",
    "TinyModelRolloutFixtures": "rlplat.testing.rollouts",
    "left_padded_prompts": "rlplat.testing.rollouts",
    "RewardManagerConformance": "rlplat.testing.reward_managers",
    "JudgeParserConformance": "rlplat.testing.judge_parsers",
    "JudgeParserCase": "rlplat.testing.judge_parsers",
    "TrainingEngineConformance": "rlplat.testing.engines",
    "word_tokenizer": "rlplat.testing.reward_managers",
    "reward_batch": "rlplat.testing.reward_managers",
}

__all__ = sorted(_LAZY_NAMES)

__getattr__, __dir__ = lazy_names('rlplat.testing', _LAZY_NAMES, globals())
