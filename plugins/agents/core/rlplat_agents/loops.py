"""The built-in agent loops (kind ``agent_loop``): ``single_turn``, ``tool`` and ``env``.

Each appends the model's sampled tokens verbatim and every other message as the token delta the chat
template adds for it (:meth:`rlplat_agents.chat.ChatRenderer.delta_ids`), within the response budget of
``rollout.response_length`` tokens per conversation. A turn that ends without its end-of-turn token
(the budget ran out) ends the conversation: nothing can be appended after half a message.

Per-trajectory metrics (``Trajectory.metrics``; the trainer reports their means): ``turns``,
``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_latency_s`` (summed over calls),
``tool_reward`` (the sum of the calls' :attr:`~rlplat.contracts.agent.ToolResult.reward`),
``model_tokens``, ``context_tokens``, ``parse_errors``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Mapping

from rlplat.contracts.agent import (
    AgentContext, AgentLoop, AgentLoopConfig, EnvStep, TokenClient, ToolCall, ToolResult, Trajectory,
)
from rlplat.kits.agent import TrajectoryBuilder

TRUNCATION_SIDES = ("left", "right", "middle")


def turn_sampling(context: AgentContext, builder: TrajectoryBuilder, turn: int, per_turn: int | None):
    """The sampling settings of one model turn: the context's, with the remaining budget (at most
    ``per_turn`` tokens), the end-of-turn stop tokens, and a seed of its own when the run is seeded."""
    budget = builder.remaining if per_turn is None else min(builder.remaining, per_turn)
    sampling = context.sampling
    seed = None if sampling.seed is None else int(sampling.seed) + 7_919 * turn
    stops = tuple(sorted(set(sampling.stop_token_ids) | set(context.stop_token_ids)))
    return dataclasses.replace(sampling, max_new_tokens=budget, stop_token_ids=stops, seed=seed, n=1)


def turn_text(context: AgentContext, token_ids: list[int]) -> str:
    """The text of a model turn without its end-of-turn token, special tokens otherwise kept (tool-call
    markers may be special tokens)."""
    ids = list(token_ids)
    while ids and ids[-1] in context.stop_token_ids:
        ids.pop()
    return context.tokenizer.decode(ids, skip_special_tokens=False)


def ended_turn(context: AgentContext, output: Any) -> bool:
    """Whether the model closed its turn (so the template's next message can follow)."""
    return output.finish_reason == "stop" and bool(output.token_ids) and output.token_ids[-1] in context.stop_token_ids


def next_turn_ids(context: AgentContext, output: Any, messages: list[dict], tools: Any = None) -> list[int]:
    """The tokens between a model turn and the next: the template's end of turn when the model stopped
    on another stop token (the tokenizer's EOS), then the delta of ``messages``."""
    closing = list(context.renderer.closing_ids(output.token_ids))
    return closing + context.renderer.delta_ids(messages, tools=tools)


async def model_turn(client: TokenClient, context: AgentContext, builder: TrajectoryBuilder, turn: int,
                     per_turn: int | None) -> Any:
    """The model's next turn, appended to ``builder``; None (nothing asked) when the budget is spent."""
    if builder.remaining <= 0:
        return None
    output = await client.generate(builder.ids, turn_sampling(context, builder, turn, per_turn))
    builder.add_model(output)
    return output


class ConfiguredLoop(AgentLoop):
    """A loop whose node (``agent.loops.<name>``) is read with its own schema when it is built."""

    schema: type = AgentLoopConfig
    key = "agent.loops"

    def __init__(self, config: Any = None):
        from rlplat.config_node import read_config_node

        super().__init__(read_config_node(config, self.schema, self.key))


# -- single turn ---------------------------------------------------------------------------------------

class SingleTurnLoop(ConfiguredLoop):
    """One model turn after the row's prompt as the data loader tokenised it: the distribution of
    :meth:`RolloutEngine.generate`, one request per row."""

    key = "agent.loops.single_turn"
    uses_tools = False

    async def run(self, row: Mapping[str, Any], client: TokenClient, context: AgentContext) -> Trajectory:
        builder = TrajectoryBuilder(context.prompt_ids, context.response_length)
        sampling = context.sampling
        if sampling.max_new_tokens != context.response_length or sampling.n != 1:
            sampling = dataclasses.replace(sampling, max_new_tokens=context.response_length, n=1)
        output = await client.generate(builder.ids, sampling)
        builder.add_model(output)
        return builder.build(1, "stop" if output.finish_reason == "stop" else "length",
                             metrics={"turns": 1.0, "model_tokens": float(len(output.token_ids)), "context_tokens": 0.0},
                             turn_metrics=[{"model_tokens": float(len(output.token_ids))}])


# -- tools ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ToolLoopConfig(AgentLoopConfig):
    """``agent.loops.tool``."""

    max_turns: int = 5
    """Most model turns (a turn that calls tools, then one that reads their results, ... ); the last
    one's tool calls are not run."""
    max_tokens_per_turn: int | None = None
    """Most tokens of one model turn (None: what is left of ``rollout.response_length``)."""
    max_parallel_calls: int = 4
    """Most tool calls run from one turn; calls beyond it get an error message."""
    tool_timeout_s: float = 30.0
    """Wall time of one tool call; a call that takes longer returns an error to the model."""
    max_tool_response_length: int = 1024
    """Most characters of one tool response the model sees; longer ones are cut at ``truncate_side``."""
    truncate_side: str = "middle"
    """Which part of a long tool response goes: ``left`` keeps the end, ``right`` the start, ``middle``
    both ends."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.truncate_side not in TRUNCATION_SIDES:
            raise ValueError(f"truncate_side must be one of {TRUNCATION_SIDES}, got {self.truncate_side!r}")
        for key in ("max_parallel_calls", "max_tool_response_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn must be >= 1 or null, got {self.max_tokens_per_turn}")


def truncate(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters on ``side``, the cut marked."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "right":
        return text[:keep] + marker
    if side == "left":
        return marker + text[len(text) - keep:]
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


class ToolLoop(ConfiguredLoop):
    """Model turns with tool calls: each turn is parsed (``agent.tool_parser``); its calls run
    concurrently, each under ``tool_timeout_s``; their results are appended as ``tool`` messages
    through the chat template; the conversation ends at a turn without calls, at ``max_turns``, or
    when the budget runs out. A malformed call, an unknown tool, a tool error or a timeout is told to
    the model as that call's result and counted."""

    schema, key = ToolLoopConfig, "agent.loops.tool"
    uses_tools = True

    async def run(self, row: Mapping[str, Any], client: TokenClient, context: AgentContext) -> Trajectory:
        if context.parser is None:
            raise ValueError("the tool agent loop needs a tool-call parser (agent.tool_parser)")
        config: ToolLoopConfig = self.config
        schemas = [tool.schema for tool, _ in context.tools.values()]
        messages = list(row.get("raw_prompt") or [])
        prompt_ids = context.renderer.prompt_ids(messages, tools=schemas or None) if schemas else list(context.prompt_ids)
        builder = TrajectoryBuilder(prompt_ids, context.response_length)
        counts = dict.fromkeys(("tool_calls", "tool_errors", "tool_timeouts", "tool_latency_s", "tool_reward",
                                "parse_errors", "model_tokens", "context_tokens"), 0.0)
        turn_metrics: list[dict[str, float]] = []
        states: dict[str, Any] = {}
        finish, turns = "stop", 0
        try:
            for name, (tool, arguments) in context.tools.items():
                states[name] = await tool.open(arguments)
            for turn in range(config.max_turns):
                output = await model_turn(client, context, builder, turn, config.max_tokens_per_turn)
                if output is None:
                    finish = "length"
                    break
                turns += 1
                counts["model_tokens"] += len(output.token_ids)
                metrics = {"model_tokens": float(len(output.token_ids)), "tool_calls": 0.0}
                turn_metrics.append(metrics)
                if not ended_turn(context, output):
                    finish = "length"
                    break
                parsed = context.parser.parse(turn_text(context, output.token_ids))
                if not parsed.calls and not parsed.errors:
                    finish = "stop"
                    break
                if turn == config.max_turns - 1:
                    finish = "max_turns"
                    break
                results = await self.run_calls(parsed, context, states, counts)
                metrics["tool_calls"] = float(len(results))
                tool_messages = [{"role": "tool", "name": name, "content": truncate(result.text, config.max_tool_response_length,
                                                                                   config.truncate_side)}
                                 for name, result in results]
                delta = next_turn_ids(context, output, tool_messages, schemas or None)
                if not builder.add_context(delta):
                    finish = "length"
                    break
                counts["context_tokens"] += len(delta)
        finally:
            for name, state in states.items():  # the tools opened, also when a later one failed to open
                try:
                    await context.tools[name][0].close(state)
                except Exception:  # a tool's clean-up must not lose the trajectory
                    counts["tool_errors"] += 1
        return builder.build(turns, finish, metrics={"turns": float(turns), **counts}, turn_metrics=turn_metrics)

    async def run_calls(self, parsed: Any, context: AgentContext, states: dict[str, Any],
                        counts: dict[str, float]) -> list[tuple[str, ToolResult]]:
        """Every call of one turn, concurrently, in order; over-limit and malformed calls get errors."""
        config: ToolLoopConfig = self.config
        calls = list(parsed.calls)
        runs = [self.run_call(call, context, states) for call in calls[: config.max_parallel_calls]]
        results = [(call.name, result) for call, result in zip(calls, await asyncio.gather(*runs))]
        for call in calls[config.max_parallel_calls:]:
            results.append((call.name, ToolResult(f"error: at most {config.max_parallel_calls} tool calls per turn; "
                                                  f"this call to {call.name} was not run", error=True)))
        for message in parsed.errors:
            counts["parse_errors"] += 1
            results.append(("error", ToolResult(f"error: {message}", error=True)))
        for _, result in results:
            counts["tool_calls"] += 1
            counts["tool_errors"] += float(result.error)
            counts["tool_timeouts"] += float(result.timed_out)
            counts["tool_latency_s"] += float(result.metrics.get("latency_s", 0.0))
            counts["tool_reward"] += float(result.reward or 0.0)
        return results

    async def run_call(self, call: ToolCall, context: AgentContext, states: dict[str, Any]) -> ToolResult:
        if call.name not in context.tools:
            offered = ", ".join(sorted(context.tools)) or "none"
            return ToolResult(f"error: there is no tool named {call.name!r}; the tools are: {offered}", error=True)
        tool, _ = context.tools[call.name]
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(tool.call(call.arguments, states[call.name]), self.config.tool_timeout_s)
        except asyncio.TimeoutError:
            result = ToolResult(f"error: {call.name} did not finish within {self.config.tool_timeout_s:g} s", error=True,
                                timed_out=True)
        except Exception as error:  # a tool that raises tells the model, the conversation goes on
            result = ToolResult(f"error: {call.name} failed: {type(error).__name__}: {error}", error=True)
        if not isinstance(result, ToolResult):
            result = ToolResult(f"error: {call.name} returned {type(result).__name__}, not a ToolResult", error=True)
        result.metrics = {**result.metrics, "latency_s": time.perf_counter() - started}
        return result


# -- environments --------------------------------------------------------------------------------------

@dataclasses.dataclass
class EnvLoopConfig(AgentLoopConfig):
    """``agent.loops.env``."""

    max_turns: int = 3
    """Most model turns (attempts); the environment may end the episode earlier."""
    max_tokens_per_turn: int | None = None
    """Most tokens of one model turn (None: what is left of ``rollout.response_length``)."""


class EnvLoop(ConfiguredLoop):
    """Model turns against an :class:`~rlplat.contracts.agent.Environment` (``agent.environment``):
    each turn's text goes to ``step``; its observation is appended as a message through the chat
    template until the environment says done, ``max_turns`` is reached, or the budget runs out. The
    trajectory's reward is the sum of the steps' rewards."""

    schema, key = EnvLoopConfig, "agent.loops.env"
    uses_tools = False

    async def run(self, row: Mapping[str, Any], client: TokenClient, context: AgentContext) -> Trajectory:
        if context.environment is None:
            raise ValueError("the env agent loop needs an environment (agent.environment)")
        config: EnvLoopConfig = self.config
        environment = context.environment()
        reward, turns, finish = 0.0, 0, "max_turns"
        counts = {"model_tokens": 0.0, "context_tokens": 0.0}
        turn_metrics: list[dict[str, float]] = []
        try:
            first = await environment.reset(row)
            prompt_ids = context.renderer.prompt_ids(first) if first is not None else list(context.prompt_ids)
            builder = TrajectoryBuilder(prompt_ids, context.response_length)
            for turn in range(config.max_turns):
                output = await model_turn(client, context, builder, turn, config.max_tokens_per_turn)
                if output is None:
                    finish = "length"
                    break
                turns += 1
                counts["model_tokens"] += len(output.token_ids)
                step = await environment.step(turn_text(context, output.token_ids))
                if not isinstance(step, EnvStep):
                    raise TypeError(f"environment {type(environment).__name__}.step returned {type(step).__name__}, not an EnvStep")
                reward += float(step.reward)
                turn_metrics.append({"model_tokens": float(len(output.token_ids)), "reward": float(step.reward), **step.metrics})
                if step.done:
                    finish = "done"
                    break
                if not ended_turn(context, output):
                    finish = "length"
                    break
                if turn == config.max_turns - 1 or step.observation is None:
                    break
                delta = next_turn_ids(context, output, [{"role": step.role, "content": step.observation}])
                if not builder.add_context(delta):
                    finish = "length"
                    break
                counts["context_tokens"] += len(delta)
        finally:
            await environment.close()
        return builder.build(turns, finish, metrics={"turns": float(turns), **counts}, turn_metrics=turn_metrics,
                             reward_score=reward)
