"""The ``blackbox`` agent loop: agents rlplat did not write, trained through the gateway.

An agent is a user's function or command. It gets one task (the row) and an OpenAI ``base_url`` of the
worker's gateway (:mod:`rlplat_agents.gateway`) naming a session of its own, talks to the policy with any
OpenAI client, and returns a reward or leaves the reward to the run's reward manager. Every token the
gateway sampled for the session is recorded; the session's last segment becomes the row's trajectory
(``response_mask`` 1 exactly on sampled tokens). Earlier segments, cut off by a prefix break, are never
merged into it: they are counted (``agent/segments``, ``agent/dropped_tokens``) and left out.

* **A function** (``agent.loops.blackbox.agent: "pkg.module:function"``) called as
  ``function(task, base_url, api_key, **agent_kwargs)``; ``async def`` functions run on the worker's
  event loop, plain ones on a thread each. It returns a float (the row's reward), None (the reward manager
  scores the final answer), or ``{"reward": float | None, "metrics": {name: float}}``.
* **A command** (``agent.loops.blackbox.command: ["python", "my_agent.py"]``), started per task with the
  task as JSON on its standard input and ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``RLPLAT_SESSION_ID``
  set; its last line of standard output, if any, is the result in the same forms as JSON (a number,
  ``null``, or the object). A non-zero exit is a failure.
* **Failures.** An agent that raises, exits non-zero, returns something else, or runs past ``timeout_s``
  (a command is killed, process group and all) gives a row with ``response_mask`` all 0 and reward 0:
  it trains nothing and the run goes on. Counted per row as ``agent_errors`` and ``agent_timeouts``; the
  first lines of each error are logged.

``task`` holds the row's columns as plain Python: ``raw_prompt`` (the chat messages), ``data_source``,
``reward_model`` (``ground_truth``), ``extra_info``, ``uid``, ...

Per-trajectory metrics: ``calls``, ``turns`` (calls of the kept segment), ``tool_calls`` (calls the model
made through the gateway's ``tool_calls``), ``prefix_breaks``, ``segments``, ``dropped_tokens``,
``model_tokens``, ``context_tokens``, ``agent_errors``, ``agent_timeouts``, ``parse_errors``,
``latency_s``, and the agent's own metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import math
import os
import signal
import time
from typing import Any, Dict, List, Mapping, Optional

from rlplat.contracts.agent import AgentContext, AgentLoopConfig, TokenClient, Trajectory
from rlplat_agents.loops import ConfiguredLoop

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BlackBoxConfig(AgentLoopConfig):
    """``agent.loops.blackbox``: the agent to run per task (exactly one of ``agent`` and ``command``)."""

    agent: Optional[str] = None
    """``"pkg.module:function"``: called as ``function(task, base_url, api_key, **agent_kwargs)``."""
    command: Optional[List[str]] = None
    """A command run per task: the task as JSON on standard input, the endpoint in ``OPENAI_BASE_URL``."""
    agent_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the function (for a command: ``RLPLAT_AGENT_KWARGS``, as JSON)."""
    timeout_s: float = 600.0
    """Wall time of one task; past it the agent's row is a failure (a command is killed)."""
    threads: int = 256
    """Threads for plain (not ``async``) agent functions, each blocking in its own; at most
    ``agent.max_concurrency`` agents run at once per worker anyway."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.agent is None) == (self.command is None):
            raise ValueError("give exactly one of agent (\"pkg.module:function\") and command (a list of arguments)")
        if self.agent is not None and (":" not in self.agent or not all(self.agent.split(":", 1))):
            raise ValueError(f"agent must be \"pkg.module:function\", got {self.agent!r}")
        if self.command is not None and (not self.command or not all(isinstance(part, str) and part for part in self.command)):
            raise ValueError(f"command must be a non-empty list of arguments, got {self.command!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


class AgentFailed(Exception):
    """An agent's run that gives a masked-out row."""


def load_function(path: str) -> Any:
    """The callable at ``"pkg.module:function"``; :class:`ValueError` naming what is missing."""
    from rlplat.registry import resolve_dotted_path

    module_name, _, attribute = path.partition(":")
    try:
        target = resolve_dotted_path(path)
    except ImportError as error:
        raise ValueError(f"agent.loops.blackbox.agent={path!r}: cannot import {module_name!r}: {error}") from None
    except AttributeError:
        raise ValueError(f"agent.loops.blackbox.agent={path!r}: {module_name} has no {attribute!r}") from None
    if not callable(target):
        raise ValueError(f"agent.loops.blackbox.agent={path!r} is a {type(target).__name__}, not a function")
    return target


def plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars turned into lists and Python numbers (JSON-able)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def read_result(value: Any, where: str) -> tuple[Optional[float], dict[str, float]]:
    """(reward, metrics) from what an agent returned; :class:`AgentFailed` when it is neither form."""
    metrics: dict[str, float] = {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"reward", "metrics"})
        if unknown:
            raise AgentFailed(f"{where} returned a dict with unknown keys {unknown}: give 'reward' and 'metrics'")
        raw_metrics = value.get("metrics") or {}
        if not isinstance(raw_metrics, Mapping):
            raise AgentFailed(f"{where} returned metrics that are not a mapping: {raw_metrics!r:.80}")
        for name, number in raw_metrics.items():
            try:
                metrics[str(name)] = float(number)
            except (TypeError, ValueError):
                raise AgentFailed(f"{where} returned metric {name!r} = {number!r:.40}, not a number") from None
        value = value.get("reward")
    if value is None:
        return None, metrics
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentFailed(f"{where} returned {type(value).__name__} {value!r:.80}; an agent returns a reward (a number), "
                          f"None, or {{'reward': ..., 'metrics': {{...}}}}")
    if not math.isfinite(float(value)):
        raise AgentFailed(f"{where} returned a non-finite reward {value!r}")
    return float(value), metrics


class BlackBoxLoop(ConfiguredLoop):
    """See the module docstring."""

    schema, key = BlackBoxConfig, "agent.loops.blackbox"
    uses_tools = False

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.function = load_function(self.config.agent) if self.config.agent is not None else None
        self.threads: Optional[concurrent.futures.ThreadPoolExecutor] = None

    async def run(self, row: Mapping[str, Any], client: TokenClient, context: AgentContext) -> Trajectory:
        gateway = context.gateway
        if gateway is None:
            raise RuntimeError("the blackbox agent loop needs the agent manager's gateway (AgentContext.gateway)")
        config: BlackBoxConfig = self.config
        task = plain(dict(row))
        session = gateway.open(client, context.sampling, task_messages=task.get("raw_prompt"),
                               response_length=context.response_length, renderer=context.renderer)
        base_url = gateway.base_url(session.id)
        api_key = gateway.config.api_key or "rlplat"
        started = time.perf_counter()
        reward: Optional[float] = None
        agent_metrics: dict[str, float] = {}
        errors = timeouts = 0
        try:
            result = await asyncio.wait_for(self.call(task, base_url, api_key, session.id), config.timeout_s)
            reward, agent_metrics = read_result(result, self.describe())
        except asyncio.TimeoutError:
            timeouts = 1
            log.warning("blackbox agent %s: task uid %s ran past timeout_s=%g; its row trains nothing",
                        self.describe(), task.get("uid"), config.timeout_s)
        except Exception as error:  # the agent's failure costs its row, not the run
            errors = 1
            log.warning("blackbox agent %s failed on task uid %s; its row trains nothing: %s: %s", self.describe(),
                        task.get("uid"), type(error).__name__, str(error)[:500])
        finally:
            gateway.close(session.id)
        failed = bool(errors or timeouts)
        return self.trajectory(session, context, reward, failed, {
            **agent_metrics, "agent_errors": float(errors), "agent_timeouts": float(timeouts),
            "latency_s": time.perf_counter() - started})

    def describe(self) -> str:
        return self.config.agent if self.config.agent is not None else " ".join(self.config.command)

    async def call(self, task: dict, base_url: str, api_key: str, session_id: str) -> Any:
        if self.function is None:
            return await self.run_command(task, base_url, api_key, session_id)
        kwargs = dict(self.config.agent_kwargs)
        if inspect.iscoroutinefunction(self.function):
            return await self.function(task, base_url, api_key, **kwargs)
        if self.threads is None:
            self.threads = concurrent.futures.ThreadPoolExecutor(self.config.threads, thread_name_prefix="rlplat-blackbox")
        result = await asyncio.get_running_loop().run_in_executor(
            self.threads, lambda: self.function(task, base_url, api_key, **kwargs))
        if inspect.isawaitable(result):
            result = await result
        return result

    async def run_command(self, task: dict, base_url: str, api_key: str, session_id: str) -> Any:
        environment = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
                       "RLPLAT_SESSION_ID": session_id, "RLPLAT_AGENT_KWARGS": json.dumps(self.config.agent_kwargs)}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.config.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=environment, start_new_session=True)
        except OSError as error:
            raise AgentFailed(f"cannot start {self.config.command!r}: {error}") from None
        try:
            stdout, stderr = await process.communicate(json.dumps(task).encode())
        except BaseException:  # a timeout (cancellation) or an error: the agent and its children go
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
            raise
        if process.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
            raise AgentFailed(f"exited with status {process.returncode}: {' | '.join(tail)}")
        lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise AgentFailed(f"its last line of output is not JSON (a number, null or an object): {lines[-1][:200]!r}") from None

    def trajectory(self, session: Any, context: AgentContext, reward: Optional[float], failed: bool,
                   metrics: dict[str, float]) -> Trajectory:
        segments = session.segments
        kept = segments[-1] if segments else None
        dropped = sum(len(segment.builder.response_ids) for segment in segments[:-1])
        metrics = {**metrics, "calls": float(session.calls), "turns": float(kept.calls if kept else 0),
                   "tool_calls": float(kept.tool_calls if kept else 0), "prefix_breaks": float(session.prefix_breaks),
                   "segments": float(len(segments)), "dropped_tokens": float(dropped),
                   "parse_errors": float(session.parse_errors)}
        if kept is None:
            builder_ids, response, mask, log_probs, versions = list(context.prompt_ids), [], [], [], []
        else:
            builder = kept.builder
            builder_ids, response = builder.prompt_ids, builder.response_ids
            mask, log_probs, versions = builder.response_mask, builder.rollout_log_probs, kept.versions
        metrics["model_tokens"] = float(sum(mask))
        metrics["context_tokens"] = float(len(mask) - sum(mask))
        if failed:
            mask, log_probs, reward = [0] * len(response), [0.0] * len(response), 0.0
        finish = "error" if failed else ("stop" if kept is not None else "no_calls")
        return Trajectory(list(builder_ids), list(response), list(mask), list(log_probs), int(metrics["turns"]), finish,
                          metrics=metrics, reward_score=reward, policy_versions=list(versions))
