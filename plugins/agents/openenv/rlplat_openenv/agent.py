"""The agent function that trains an OpenEnv environment through the ``blackbox`` agent loop.

::

    agent.loop=blackbox
    agent.loops.blackbox.agent=rlplat_openenv.agent:run
    agent.loops.blackbox.agent_kwargs={app: "my_env.server.app:app", action_field: answer, message_field: feedback}

Per task, :func:`run` opens a session of the environment server (OpenEnv's ``GenericEnvClient``: one
WebSocket session, its own environment instance on the server), resets it with the task, and plays the
episode: the policy answers through the gateway's ``base_url`` (``openai.AsyncOpenAI``), each answer is
stepped as an action ``{action_field: text}``, and the observation's ``message_field`` is the next user
message, until the environment says ``done``, ``max_turns`` answers were given, or the trajectory's token
budget is spent (the gateway's ``context_length_exceeded``: the episode ends there, as the ``env`` loop's
would at ``rollout.response_length``). The row's reward is the sum of the step rewards the environment
returned (its rubric's scores); the gateway records every sampled token, and the feedback turns are
context (mask 0).

* **Where the environment runs.** ``env_url``: a server already running (``http://host:port``, e.g. the
  container ``docker run`` or ``openenv`` started). Otherwise ``app`` (``"module:attribute"``, the
  ``create_app(...)`` result of the environment's ``server/app.py``) is served by this process on
  127.0.0.1 (:mod:`rlplat_openenv.server`); the default is the demo task's :mod:`rlplat_openenv.arithmetic`.
* **Reset.** ``reset(task=<the row>, episode_id=<uid>, **reset_kwargs)``: the server passes an
  environment's ``reset`` the keywords its signature accepts.
* **The first turn** is the row's ``raw_prompt``; with ``prompt_field`` set, the reset observation's field
  is the user message instead (an environment that poses its own task).

Metrics: ``openenv/steps`` (actions stepped), ``openenv/done`` (1 when the environment ended the
episode), ``openenv/truncated`` (1 when the token budget did).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

DEFAULT_APP = "rlplat_openenv.arithmetic:app"
"""The environment :func:`run` serves when ``agent_kwargs`` names neither ``env_url`` nor ``app``."""


async def run(task: dict, base_url: str, api_key: str, app: str = DEFAULT_APP, env_url: Optional[str] = None,
              reset_kwargs: Optional[Mapping[str, Any]] = None, action_field: str = "answer",
              message_field: str = "feedback", prompt_field: Optional[str] = None, max_turns: int = 8,
              model: str = "policy", max_tokens: Optional[int] = None) -> dict:
    """One episode of the environment for ``task``; ``{"reward": the sum of its step rewards, "metrics":
    {"openenv/steps": ..., "openenv/done": ..., "openenv/truncated": ...}}``. See the module docstring."""
    import openai
    from openenv.core.generic_client import GenericEnvClient

    from rlplat_openenv.server import serve

    if max_turns < 1:
        raise ValueError(f"agent_kwargs.max_turns must be >= 1, got {max_turns}")
    messages = [dict(message) for message in task.get("raw_prompt") or []]
    if prompt_field is None and not messages:
        raise ValueError(f"task uid {task.get('uid')!r} has no raw_prompt: give agent_kwargs.prompt_field to take "
                         f"the first user message from the environment's reset observation")
    policy = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    environment = GenericEnvClient(base_url=env_url or serve(app))
    reward, steps, done, truncated = 0.0, 0, False, False
    try:
        async with environment:
            result = await environment.reset(task=task, episode_id=str(task.get("uid", "")) or None, **dict(reset_kwargs or {}))
            if prompt_field is not None:
                messages.append({"role": "user", "content": observation_text(result.observation, prompt_field, "reset")})
            done = bool(result.done)
            while not done and steps < max_turns:
                try:
                    completion = await policy.chat.completions.create(
                        model=model, messages=messages, **({} if max_tokens is None else {"max_tokens": max_tokens}))
                except openai.BadRequestError as error:
                    if error.code != "context_length_exceeded":
                        raise
                    truncated = True
                    break
                text = completion.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                result = await environment.step({action_field: text})
                steps += 1
                reward += float(result.reward or 0.0)
                done = bool(result.done)
                if not done and steps < max_turns:
                    messages.append({"role": "user", "content": observation_text(result.observation, message_field, "step")})
    finally:
        await policy.close()
    return {"reward": reward, "metrics": {"openenv/steps": float(steps), "openenv/done": float(done),
                                          "openenv/truncated": float(truncated)}}


def observation_text(observation: Mapping[str, Any], name: str, after: str) -> str:
    """The observation's field ``name`` as text; :class:`ValueError` naming the fields there are."""
    if name not in observation:
        raise ValueError(f"the environment's {after} observation has no field {name!r} (it has {sorted(observation)}): "
                         f"set {'prompt_field' if after == 'reset' else 'message_field'} to one of them")
    return str(observation[name])
