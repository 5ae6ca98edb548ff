"""The ``agent`` node of the run config (light: the driver reads it without torch)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional

VERL_LOOP_NAMES = {"single_turn_agent": "single_turn", "tool_agent": "tool"}
"""verl's ``agent_name`` values, read as rlplat's loop names."""


@dataclasses.dataclass
class AgentConfig:
    """The ``agent`` node: multi-turn rollouts through agent loops. With no ``agent.loop`` and no
    ``agent_name`` column in the data, generation is the rollout's batched ``generate``."""

    loop: Optional[str] = None
    """Agent loop (kind ``agent_loop``: ``single_turn``, ``tool``, ``env``, a plugin's) for rows without an
    ``agent_name``. None: rows must name theirs, or the run generates without agent loops."""
    loops: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Each loop's own node: ``agent.loops.tool.max_turns=4``, checked against the loop's schema."""
    tools_config: Optional[str] = None
    """YAML file of the tools offered (see :mod:`rlplat.agent.tools`)."""
    tool_parser: str = "hermes"
    """How the model writes tool calls (kind ``tool_parser``)."""
    environment: Optional[str] = None
    """Environment of the ``env`` loop (kind ``environment``: ``retry``, a plugin's)."""
    environment_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The environment's own node."""
    max_concurrency: int = 256
    """Conversations in flight at once per worker."""
    max_prompt_length: Optional[int] = None
    """Width of the prompts of agent batches (a prompt rendered with its tools is longer than the data
    loader's). None: ``data.max_prompt_length``. A longer prompt is an error naming the row."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")

    def enabled(self, has_agent_names: bool = False) -> bool:
        """Whether generation goes through agent loops: a default loop is set, or the rows name theirs."""
        return self.loop is not None or has_agent_names


def check_tools_read(agent: AgentConfig, loops: Iterable[str]) -> None:
    """:class:`~rlplat.config_node.ConfigError` when ``agent.tools_config`` is set but no agent loop of the
    run offers its tools: ``loops`` (the loops the run uses: ``agent.loop`` and the data's ``agent_name``
    values, rlplat's names) is empty, so generation is single-turn, or every one of them declares
    ``uses_tools = False``. A loop that does not declare it is trusted to read them."""
    if agent.tools_config is None:
        return
    from rlplat import registry
    from rlplat.config_node import ConfigError

    loops = sorted(set(loops))
    fix = ("set agent.loop=tool (verl: actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent), give the rows "
           "an agent_name column naming a loop that offers tools (verl's tool_agent), or drop agent.tools_config")
    if not loops:
        raise ConfigError(f"agent.tools_config={agent.tools_config} is read by no agent loop: agent.loop is not set and "
                          f"the data names no loop (no agent_name values), so generation is single-turn and the tools "
                          f"are never offered; {fix}.")
    if all(getattr(registry.get("agent_loop", name), "uses_tools", None) is False for name in loops):
        raise ConfigError(f"agent.tools_config={agent.tools_config} is read by no agent loop of this run: "
                          f"{', '.join(loops)} offer{'s' if len(loops) == 1 else ''} no tools; {fix}.")
