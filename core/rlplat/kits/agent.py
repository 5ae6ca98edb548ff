"""The agent kit: what an agent loop (kind ``agent_loop``, :class:`rlplat.contracts.agent.AgentLoop`) builds its
:class:`~rlplat.contracts.agent.Trajectory` with, turn by turn, within the response budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from rlplat.contracts.agent import Trajectory

if TYPE_CHECKING:
    from rlplat.contracts.rollout import TokenOutput


class TrajectoryBuilder:
    """Accumulates a conversation's tokens within a budget of ``response_length`` response tokens."""

    def __init__(self, prompt_ids: Sequence[int], response_length: int):
        self.prompt_ids = list(prompt_ids)
        self.response_length = response_length
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.rollout_log_probs: list[float] = []
        self.versions: list[int] = []
        """Per response token, the policy version that sampled it (-1 on tokens not sampled), kept once a
        model turn reports versions (:attr:`TokenOutput.versions`)."""
        self.has_versions = False

    @property
    def remaining(self) -> int:
        """Response tokens still allowed."""
        return self.response_length - len(self.response_ids)

    @property
    def ids(self) -> list[int]:
        """Everything so far, prompt first: what the next turn is generated after."""
        return self.prompt_ids + self.response_ids

    def add_model(self, output: "TokenOutput") -> None:
        """Append the model's sampled tokens verbatim (mask 1, their log-probs)."""
        if len(output.token_ids) > self.remaining:
            raise ValueError(f"the model returned {len(output.token_ids)} tokens, {self.remaining} were allowed")
        if len(output.log_probs) != len(output.token_ids):
            raise ValueError(f"the model returned {len(output.token_ids)} tokens but {len(output.log_probs)} log-probs")
        self.response_ids += list(output.token_ids)
        self.response_mask += [1] * len(output.token_ids)
        self.rollout_log_probs += [float(value) for value in output.log_probs]
        versions = getattr(output, "versions", None)
        if versions is not None and len(versions) == len(output.token_ids):
            self.has_versions = True
            self.versions += [int(version) for version in versions]
        else:
            self.versions += [-1] * len(output.token_ids)

    def add_context(self, token_ids: Sequence[int]) -> bool:
        """Append tokens the model did not sample (mask 0); False, and nothing appended, when they do
        not fit in the budget (the conversation then ends)."""
        if len(token_ids) > self.remaining:
            return False
        self.response_ids += list(token_ids)
        self.response_mask += [0] * len(token_ids)
        self.rollout_log_probs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        return True

    def build(self, num_turns: int, finish_reason: str, **fields: Any) -> Trajectory:
        if self.has_versions:
            fields.setdefault("policy_versions", list(self.versions))
        return Trajectory(self.prompt_ids, self.response_ids, self.response_mask, self.rollout_log_probs,
                          num_turns, finish_reason, **fields)
