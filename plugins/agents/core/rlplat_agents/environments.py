"""Built-in environments (kind ``environment``) for the ``env`` agent loop."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, Optional

from rlplat.contracts.agent import EnvStep, Environment


@dataclasses.dataclass
class RetryConfig:
    """``agent.environment_config`` of the ``retry`` environment."""

    feedback: str = "wrong, try again"
    """The message after a wrong answer."""
    scorer: Optional[str] = None
    """Registered scorer (kind ``reward_scorer``) that judges an answer; None: the one the row's
    ``data_source`` claims (as the reward does), else ``exact_match``."""
    success_reward: float = 1.0
    """Reward of the turn that answers correctly (the episode then ends)."""
    attempt_discount: float = 1.0
    """The success reward is multiplied by this once per earlier wrong attempt (1.0: no penalty)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.attempt_discount <= 1.0:
            raise ValueError(f"attempt_discount must be in [0, 1], got {self.attempt_discount}")


class RetryEnvironment(Environment):
    """Each model turn is an answer to the row's task, judged by the row's scorer against
    ``reward_model.ground_truth``; a wrong answer gets ``feedback`` as a user message, a right one ends
    the episode with ``success_reward`` (discounted per earlier wrong attempt)."""

    def __init__(self, config: Any = None):
        from rlplat.config_node import read_config_node
        from rlplat.scorers import scorer_for

        super().__init__(read_config_node(config, RetryConfig, "agent.environment_config"))
        self.scorer = scorer_for(self.config.scorer, None)
        self.row: Mapping[str, Any] = {}
        self.attempts = 0

    async def reset(self, row: Mapping[str, Any]) -> None:
        self.row, self.attempts = row, 0
        return None

    async def step(self, response: str) -> EnvStep:
        reward_model = self.row.get("reward_model") or {}
        value = self.scorer(data_source=self.row.get("data_source", ""), solution_str=response,
                            ground_truth=reward_model.get("ground_truth"), extra_info=self.row.get("extra_info") or {})
        if inspect.isawaitable(value):  # an async custom scorer
            value = await value
        score = float(value["score"]) if isinstance(value, Mapping) else float(value)
        correct = bool(value.get("acc", score > 0)) if isinstance(value, Mapping) else score > 0
        self.attempts += 1
        if correct:
            reward = self.config.success_reward * self.config.attempt_discount ** (self.attempts - 1)
            return EnvStep(None, reward=reward, done=True, metrics={"correct": 1.0})
        return EnvStep(self.config.feedback, reward=0.0, done=False, metrics={"correct": 0.0})
