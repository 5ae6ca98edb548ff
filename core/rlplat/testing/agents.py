"""Conformance suites for the agent kinds: ``agent_loop``, ``tool``, ``tool_parser``, ``environment``.

Agent-loop suites run the loop against a :class:`~rlplat.contracts.agent.TokenClient` the plugin's
test provides (a real rollout engine through :class:`rlplat_agents.manager.EngineClient`, or
:class:`ScriptedClient`, which plays given model turns so that tool calls happen on demand) and check
the invariants every trainer relies on: the trained tokens are the sampled ones, each turn was
generated after exactly the tokens the trajectory holds before it, masks and log-probs line up.

:class:`ScriptedPolicy` plays the model's side one level up, as an OpenAI-compatible chat endpoint, for
the environment hubs that talk to the rollout worker's gateway.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
from typing import Any, Mapping, Sequence, Union

import pytest

from rlplat.contracts.agent import (
    AgentContext, AgentLoop, EnvStep, Environment, ParsedTurn, Tool, ToolCall, ToolCallParser, ToolResult, Trajectory,
)
from rlplat.contracts.rollout import SamplingParams, TokenOutput


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


# -- clients ------------------------------------------------------------------------------------------

class ScriptedClient:
    """Plays the given model turns in order (text encoded with ``tokenizer``, then ``stop_token_id``),
    cut to the turn's ``max_new_tokens`` like a real engine (finish reason ``length`` then); after the
    script it repeats the last turn. Log-probs are ``-0.25`` per token: the model's side of a test,
    not a model."""

    def __init__(self, tokenizer: Any, turns: Sequence[str], stop_token_id: int):
        self.tokenizer, self.turns, self.stop_token_id = tokenizer, list(turns), stop_token_id
        self.calls = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        await asyncio.sleep(0)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.stop_token_id]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return TokenOutput(ids, [-0.25] * len(ids), finish)


class RecordingClient:
    """Wraps a client and records every request and answer (for the invariants)."""

    def __init__(self, client: Any):
        self.client = client
        self.requests: list[tuple[list[int], SamplingParams, TokenOutput]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        output = await self.client.generate(list(prompt_ids), sampling)
        self.requests.append((list(prompt_ids), sampling, output))
        return output


PolicyReply = Union[str, dict]
"""A reply's text, or ``{"status": 400, "message": ..., "code": ...}`` for an OpenAI error answer."""


class ScriptedPolicy:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that answers with given replies, standing in for
    the rollout worker's gateway in an environment hub's tests (no model, no training run). It serves
    ``POST /v1/chat/completions``: each request gets the next reply; ``requests`` holds their JSON bodies.
    An ``async with`` block serves it on the running event loop (aiohttp)."""

    def __init__(self, replies: Sequence[PolicyReply]):
        self.replies, self.requests = list(replies), []
        self.base_url = ""

    async def __aenter__(self) -> "ScriptedPolicy":
        from aiohttp import web

        application = web.Application()
        application.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(application)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.runner.cleanup()

    async def chat(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        reply = self.replies.pop(0)
        if isinstance(reply, dict):
            error = {"message": reply["message"], "type": "invalid_request_error", "param": None, "code": reply.get("code")}
            return web.json_response({"error": error}, status=reply["status"])
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})


def check_trajectory_against_requests(trajectory: Trajectory, requests: Sequence[tuple[list[int], Any, TokenOutput]],
                                      response_length: int) -> None:
    """The invariants of one conversation (``AssertionError`` with what broke)."""
    assert isinstance(trajectory, Trajectory), f"run returned {type(trajectory).__name__}, not a Trajectory"
    trajectory.check(response_length)
    sequence = trajectory.prompt_ids + trajectory.response_ids
    sampled_positions = [len(trajectory.prompt_ids) + i for i, keep in enumerate(trajectory.response_mask) if keep]
    sampled: list[int] = []
    log_probs: list[float] = []
    for number, (prompt_ids, sampling, output) in enumerate(requests):
        assert sequence[: len(prompt_ids)] == prompt_ids, (
            f"request {number} was generated after tokens that are not a prefix of the trajectory: the loop "
            "re-rendered or changed earlier tokens (trained tokens would differ from sampled ones)")
        assert len(output.token_ids) <= sampling.max_new_tokens
        start = len(prompt_ids)
        assert sequence[start: start + len(output.token_ids)] == list(output.token_ids), (
            f"the tokens of turn {number} are not appended verbatim after its prompt")
        sampled += list(output.token_ids)
        log_probs += list(output.log_probs)
    assert sum(trajectory.response_mask) == len(sampled), (
        f"response_mask marks {sum(trajectory.response_mask)} tokens, the model sampled {len(sampled)}")
    assert [sequence[p] for p in sampled_positions] == sampled, "response_mask is 1 on tokens the model did not sample"
    got = [trajectory.rollout_log_probs[p - len(trajectory.prompt_ids)] for p in sampled_positions]
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(got, log_probs)), "rollout_log_probs are not the sampled log-probs"
    assert trajectory.num_turns == len(requests), f"num_turns is {trajectory.num_turns}, the model was asked {len(requests)} times"


class AgentLoopConformance:
    """Fixtures to provide: ``agent_loop`` (a built :class:`AgentLoop`), ``agent_context`` (an
    :class:`AgentContext` for its rows), ``agent_rows`` (rows: dicts of the batch's non-tensor columns,
    ``raw_prompt`` at least) and ``make_client`` (a function returning a fresh TokenClient)."""

    def run_rows(self, agent_loop, agent_context, agent_rows, make_client):
        async def one(row):
            client = RecordingClient(make_client())
            trajectory = await agent_loop.run(row, client, copy.copy(agent_context))
            return trajectory, client.requests

        async def every():
            return await asyncio.gather(*(one(row) for row in agent_rows))

        return run(every())

    def test_is_an_agent_loop(self, agent_loop):
        assert isinstance(agent_loop, AgentLoop)

    def test_trajectories_hold_exactly_the_sampled_tokens(self, agent_loop, agent_context, agent_rows, make_client):
        for trajectory, requests in self.run_rows(agent_loop, agent_context, agent_rows, make_client):
            check_trajectory_against_requests(trajectory, requests, agent_context.response_length)

    def test_stays_within_a_small_budget(self, agent_loop, agent_context, agent_rows, make_client):
        context = dataclasses.replace(agent_context, response_length=3)
        for trajectory, requests in self.run_rows(agent_loop, context, agent_rows, make_client):
            check_trajectory_against_requests(trajectory, requests, 3)

    def test_does_not_modify_the_rows(self, agent_loop, agent_context, agent_rows, make_client):
        before = copy.deepcopy(agent_rows)
        self.run_rows(agent_loop, agent_context, agent_rows, make_client)
        assert agent_rows == before

    def test_prompt_starts_the_conversation(self, agent_loop, agent_context, agent_rows, make_client):
        for trajectory, requests in self.run_rows(agent_loop, agent_context, agent_rows, make_client):
            assert requests, "the loop never asked the model"
            assert requests[0][0] == trajectory.prompt_ids, "the first turn is not generated after the trajectory's prompt"


# -- tools --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolCase:
    """A call and what must come back: ``expected`` is contained in the text; ``error`` whether it fails."""

    arguments: Mapping[str, Any]
    expected: str
    error: bool = False
    row_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class ToolConformance:
    """Fixtures to provide: ``tool`` (a built :class:`Tool`) and ``tool_cases`` (:class:`ToolCase` s,
    at least one success and one failure)."""

    async def call(self, tool: Tool, case: ToolCase) -> ToolResult:
        state = await tool.open(dict(case.row_kwargs))
        try:
            return await tool.call(dict(case.arguments), state)
        finally:
            await tool.close(state)

    def test_is_a_tool_with_a_function_schema(self, tool):
        from rlplat.contracts.agent import check_tool_schema

        assert isinstance(tool, Tool)
        check_tool_schema(tool.schema, type(tool).__name__)
        assert tool.name == tool.schema["function"]["name"]
        check_tool_schema(type(tool).default_schema(), type(tool).__name__)

    def test_cases(self, tool, tool_cases):
        assert any(c.error for c in tool_cases) and any(not c.error for c in tool_cases), \
            "tool_cases must hold at least one success and one failure"
        for case in tool_cases:
            result = run(self.call(tool, case))
            assert isinstance(result, ToolResult), f"{case}: returned {type(result).__name__}, not a ToolResult"
            assert isinstance(result.text, str)
            assert result.error == case.error, f"{case}: error={result.error}, text={result.text!r:.200}"
            assert case.expected in result.text, f"{case}: {case.expected!r} not in {result.text!r:.200}"

    @pytest.mark.parametrize("arguments", [{}, {"unexpected": 1}, {"__class__": None}])
    def test_bad_arguments_are_an_error_result_not_an_exception(self, tool, arguments):
        result = run(self.call(tool, ToolCase(arguments, "")))
        assert isinstance(result, ToolResult) and result.error, result

    def test_concurrent_calls_are_independent(self, tool, tool_cases):
        async def every():
            return await asyncio.gather(*(self.call(tool, case) for case in list(tool_cases) * 3))

        for case, result in zip(list(tool_cases) * 3, run(every())):
            assert result.error == case.error and case.expected in result.text, (case, result)


# -- parsers ------------------------------------------------------------------------------------------

PARSER_CALL_SETS = (
    [ToolCall("calculator", {"expression": "37*48"})],
    [ToolCall("search", {"query": "größe", "limit": 3}), ToolCall("python", {"code": "print('a\\nb')"})],
    [ToolCall("nested", {"a": {"b": [1, 2, {"c": None}]}, "flag": True})],
    [ToolCall("no_arguments", {})],
)
GARBAGE = ("", "plain answer", "{}", "<tool_call>", "</tool_call>", "<tool_call>{\"name\": 1}</tool_call>",
           "<tool_call>not json</tool_call>", "<tool_call>[1, 2]</tool_call>", "\x00\x01", "<tool_call><tool_call>{}")


class ToolCallParserConformance:
    """Fixture to provide: ``parser`` (a built :class:`ToolCallParser`)."""

    def test_is_a_parser(self, parser):
        assert isinstance(parser, ToolCallParser)

    @pytest.mark.parametrize("calls", PARSER_CALL_SETS)
    def test_format_then_parse_gives_the_calls_back(self, parser, calls):
        parsed = parser.parse(parser.format(calls, "Let me compute."))
        assert isinstance(parsed, ParsedTurn)
        assert [(c.name, dict(c.arguments)) for c in parsed.calls] == [(c.name, dict(c.arguments)) for c in calls]
        assert parsed.errors == ()
        assert "Let me compute." in parsed.content

    def test_text_without_calls_is_content(self, parser):
        parsed = parser.parse("The answer is 42.")
        assert parsed.calls == () and parsed.errors == () and parsed.content == "The answer is 42."

    @pytest.mark.parametrize("text", GARBAGE)
    def test_malformed_text_never_raises(self, parser, text):
        parsed = parser.parse(text)
        assert isinstance(parsed, ParsedTurn)
        assert all(isinstance(call, ToolCall) for call in parsed.calls)


# -- environments -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EnvironmentCase:
    """A row with an answer that solves it and one that does not."""

    row: Mapping[str, Any]
    solving: str
    failing: str


class EnvironmentConformance:
    """Fixtures to provide: ``make_environment`` (a function returning a new :class:`Environment`) and
    ``environment_cases`` (:class:`EnvironmentCase` s)."""

    async def episode(self, environment: Environment, row: Mapping[str, Any], answers: Sequence[str]) -> list[EnvStep]:
        first = await environment.reset(row)
        assert first is None or (isinstance(first, list) and all(isinstance(m, dict) and "role" in m for m in first)), first
        steps = []
        for answer in answers:
            step = await environment.step(answer)
            assert isinstance(step, EnvStep), f"step returned {type(step).__name__}, not an EnvStep"
            assert math.isfinite(step.reward)
            steps.append(step)
            if step.done:
                break
        await environment.close()
        return steps

    def test_is_an_environment(self, make_environment):
        assert isinstance(make_environment(), Environment)

    def test_solving_answer_ends_with_more_reward_than_failing(self, make_environment, environment_cases):
        for case in environment_cases:
            solved = run(self.episode(make_environment(), case.row, [case.solving]))
            failed = run(self.episode(make_environment(), case.row, [case.failing]))
            assert solved[-1].done, f"{case}: the solving answer did not end the episode"
            assert sum(s.reward for s in solved) > sum(s.reward for s in failed), case
            if not failed[-1].done:
                assert isinstance(failed[-1].observation, str) and failed[-1].observation, \
                    "an episode that goes on needs an observation for the model"

    def test_instances_are_independent(self, make_environment, environment_cases):
        case = environment_cases[0]

        async def both():
            return await asyncio.gather(self.episode(make_environment(), case.row, [case.failing, case.solving]),
                                        self.episode(make_environment(), case.row, [case.solving]))

        interleaved, direct = run(both())
        assert direct[-1].done and len(direct) == 1
        assert interleaved[-1].done

    def test_does_not_modify_the_row(self, make_environment, environment_cases):
        case = environment_cases[0]
        before = copy.deepcopy(case.row)
        run(self.episode(make_environment(), case.row, [case.failing, case.solving]))
        assert case.row == before
