"""An OpenEnv environment as an rlplat environment (kind ``environment``, name ``openenv``) for the ``env``
agent loop: the same episode as :func:`rlplat_openenv.agent.run` plays through the gateway, with the
loop's own token handling (each model turn sampled from the rollout engine, the feedback appended through
the chat template) and no HTTP hop for the model's turns.

::

    agent.loop=env agent.environment=openenv
    agent.environment_config={app: "my_env.server.app:app", action_field: answer, message_field: feedback}

Per conversation: a session of the environment's server (served on 127.0.0.1 by
:mod:`rlplat_openenv.server`, or at ``env_url``), ``reset(task=<row as JSON>, **reset_kwargs)``, and each model turn
stepped as ``{action_field: text}``; the step's reward is the environment's (its rubric's), the
observation's ``message_field`` the next user message. ``agent.loops.env.max_turns`` bounds the turns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping, Optional

from rlplat.contracts.agent import EnvStep, Environment

from rlplat_openenv.agent import DEFAULT_APP, observation_text


@dataclasses.dataclass
class OpenEnvConfig:
    """``agent.environment_config`` of the ``openenv`` environment."""

    app: str = DEFAULT_APP
    """``"module:attribute"``: the environment's ASGI app (``create_app(...)``), served on 127.0.0.1 by the
    rollout worker; ignored when ``env_url`` is set."""
    env_url: Optional[str] = None
    """``http://host:port`` of an environment server already running (a container); None: serve ``app``."""
    reset_kwargs: dict = dataclasses.field(default_factory=dict)
    """Keywords of every ``reset`` besides ``task`` (the row) and ``episode_id`` (its uid)."""
    action_field: str = "answer"
    """The action's field that holds the model's turn (its text)."""
    message_field: str = "feedback"
    """The observation's field appended as the next user message while the episode goes on."""
    prompt_field: Optional[str] = None
    """The reset observation's field that is the first user message; None: the row's prompt."""

    def __post_init__(self) -> None:
        if ":" not in self.app:
            raise ValueError(f"app must be \"module:attribute\" (an OpenEnv create_app(...) result), got {self.app!r}")
        if not self.action_field or not self.message_field:
            raise ValueError("action_field and message_field must name fields of the environment's action and observation")


def plain(value: Any) -> Any:
    """``value`` as JSON can carry it to the server: numpy arrays and scalars (a batch's columns) become
    lists and Python numbers, mappings plain dicts."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


class OpenEnvEnvironment(Environment):
    """See the module docstring. One instance (one server session) per conversation."""

    def __init__(self, config: Any = None):
        from rlplat.config_node import read_config_node

        super().__init__(read_config_node(config, OpenEnvConfig, "agent.environment_config"))
        self.session = contextlib.AsyncExitStack()
        self.client: Any = None

    async def reset(self, row: Mapping[str, Any]) -> Optional[list[dict[str, Any]]]:
        from openenv.core.generic_client import GenericEnvClient

        from rlplat_openenv.server import serve

        config: OpenEnvConfig = self.config
        self.client = await self.session.enter_async_context(GenericEnvClient(base_url=config.env_url or serve(config.app)))
        task = plain(row)
        result = await self.client.reset(task=task, episode_id=str(task.get("uid", "")) or None, **config.reset_kwargs)
        if config.prompt_field is None:
            return None
        return [{"role": "user", "content": observation_text(result.observation, config.prompt_field, "reset")}]

    async def step(self, response: str) -> EnvStep:
        config: OpenEnvConfig = self.config
        result = await self.client.step({config.action_field: response})
        done = bool(result.done)
        message = None if done else observation_text(result.observation, config.message_field, "step")
        return EnvStep(message, reward=float(result.reward or 0.0), done=done)

    async def close(self) -> None:
        self.client = None
        await self.session.aclose()
