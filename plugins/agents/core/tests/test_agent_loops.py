"""Agent loops, tools, the hermes parser, the retry environment and the manager: conformance suites for
the built-ins and the behaviours the trainer relies on."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest
import torch

from rlplat import hookimpl, registry
from rlplat_agents.chat import ChatRenderer
from rlplat_agents.config import AgentConfig
from rlplat_agents.environments import RetryEnvironment
from rlplat_agents.loops import EnvLoop, SingleTurnLoop, ToolLoop, truncate
from rlplat_agents.manager import AgentLoopManager, EngineClient, agent_metrics
from rlplat_agents.parsers import HermesParser
from rlplat_agents.tools import CalculatorTool, read_tools_file, row_tools
from rlplat.config_node import ConfigError
from rlplat.contracts.agent import AgentContext, Tool, ToolCall, ToolResult
from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.data import collate
from rlplat.testing import (
    AgentLoopConformance, EnvironmentCase, EnvironmentConformance, ScriptedClient, ToolCallParserConformance, ToolCase,
    ToolConformance,
)
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, chat_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(CHATML_TOOLS)


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


def row(prompt="What is 37*48?", **extra):
    return {"raw_prompt": [{"role": "user", "content": prompt}], "data_source": "t", "uid": "u0",
            "reward_model": {"ground_truth": "1776"}, "extra_info": dict(extra)}


def context_for(tokenizer, renderer, tools=None, response_length=256, environment=None, seed=None):
    calculator = CalculatorTool()
    offered = {"calculator": (calculator, {})} if tools is None else tools
    return AgentContext(tokenizer=tokenizer, renderer=renderer, sampling=SamplingParams(seed=seed),
                        response_length=response_length,
                        prompt_ids=renderer.prompt_ids(row()["raw_prompt"]), tools=offered, parser=HermesParser(),
                        stop_token_ids=renderer.stop_token_ids, environment=environment)


def stop_id(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


# -- conformance of the built-ins ---------------------------------------------------------------------

class TestHermesParser(ToolCallParserConformance):
    @pytest.fixture
    def parser(self):
        return registry.get("tool_parser", "hermes")(None)


def test_hermes_reads_string_arguments_and_reports_each_bad_call():
    parsed = HermesParser().parse('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b '
                                  '<tool_call>{"name": "g", "arguments": [1]}</tool_call><tool_call>oops')
    assert parsed.calls == (ToolCall("f", {"x": 1}),)
    assert len(parsed.errors) == 2 and "'arguments' must be a JSON object" in parsed.errors[0]
    assert "without a closing" in parsed.errors[1]
    assert parsed.content == "a  b"


class TestCalculatorTool(ToolConformance):
    @pytest.fixture
    def tool(self):
        return registry.get("tool", "calculator")({})

    @pytest.fixture
    def tool_cases(self):
        return [ToolCase({"expression": "37*48"}, "1776"), ToolCase({"expression": "(1+2)/4"}, "0.75"),
                ToolCase({"expression": "1/0"}, "error", error=True),
                ToolCase({"expression": "__import__('os').system('true')"}, "error", error=True)]


class TestRetryEnvironment(EnvironmentConformance):
    @pytest.fixture
    def make_environment(self):
        return lambda: registry.get("environment", "retry")({})

    @pytest.fixture
    def environment_cases(self):
        return [EnvironmentCase(row(), "1776", "1777"), EnvironmentCase(row("2+2="), " 1776 ", "4")]


def test_retry_discounts_later_attempts_and_says_try_again():
    environment = RetryEnvironment({"attempt_discount": 0.5, "feedback": "no, again"})

    async def episode():
        await environment.reset(row())
        return [await environment.step("1"), await environment.step("1776")]

    first, second = asyncio.run(episode())
    assert first.observation == "no, again" and not first.done and first.reward == 0
    assert second.done and second.reward == 0.5


class ScriptedLoopSuite(AgentLoopConformance):
    turns: tuple[str, ...] = ()

    @pytest.fixture
    def agent_rows(self):
        return [row(), row("2*3="), row("9*9=")]

    @pytest.fixture
    def make_client(self, tokenizer):
        return lambda: ScriptedClient(tokenizer, self.turns, stop_id(tokenizer))


class TestSingleTurnLoop(ScriptedLoopSuite):
    turns = ("1776",)

    @pytest.fixture
    def agent_loop(self):
        return registry.get("agent_loop", "single_turn")({})

    @pytest.fixture
    def agent_context(self, tokenizer, renderer):
        return context_for(tokenizer, renderer)


class TestToolLoop(ScriptedLoopSuite):
    turns = (CALL, CALL + "\n" + CALL.replace("37*48", "2*3"), "1776")

    @pytest.fixture
    def agent_loop(self):
        return registry.get("agent_loop", "tool")({"max_turns": 4})

    @pytest.fixture
    def agent_context(self, tokenizer, renderer):
        return context_for(tokenizer, renderer)


class TestEnvLoop(ScriptedLoopSuite):
    turns = ("12", "1776")

    @pytest.fixture
    def agent_loop(self):
        return registry.get("agent_loop", "env")({"max_turns": 3})

    @pytest.fixture
    def agent_context(self, tokenizer, renderer):
        return context_for(tokenizer, renderer, environment=lambda: RetryEnvironment({}))


# -- the tool loop's behaviour --------------------------------------------------------------------------

def run_tool_loop(tokenizer, renderer, turns, config=None, tools=None, response_length=256, the_row=None):
    loop = ToolLoop(config or {})
    client = ScriptedClient(tokenizer, turns, stop_id(tokenizer))
    trajectory = asyncio.run(loop.run(the_row or row(), client, context_for(tokenizer, renderer, tools, response_length)))
    return trajectory, client


def response_text(tokenizer, trajectory, sampled: bool | None = None):
    ids = [t for t, m in zip(trajectory.response_ids, trajectory.response_mask) if sampled is None or m == sampled]
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_tool_result_is_appended_through_the_template_and_the_conversation_equals_its_rendering(tokenizer, renderer):
    trajectory, _ = run_tool_loop(tokenizer, renderer, [CALL, "1776"])
    assert trajectory.num_turns == 2 and trajectory.finish_reason == "stop"
    assert trajectory.metrics["tool_calls"] == 1 and trajectory.metrics["tool_errors"] == 0
    assert "<tool_response>\n1776\n</tool_response>" in response_text(tokenizer, trajectory, sampled=False)
    messages = [*row()["raw_prompt"],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}]},
                {"role": "tool", "name": "calculator", "content": "1776"}, {"role": "assistant", "content": "1776"}]
    schema = [CalculatorTool().schema]
    full = renderer.encode(renderer.render(messages, schema))
    assert trajectory.prompt_ids + trajectory.response_ids == full[: len(trajectory.prompt_ids) + len(trajectory.response_ids)]


def test_tools_run_concurrently_and_a_slow_one_times_out(tokenizer, renderer):
    class Sleepy(Tool):
        @classmethod
        def default_schema(cls):
            return {"type": "function", "function": {"name": "sleepy", "parameters": {"type": "object"}}}

        async def call(self, arguments, state):
            await asyncio.sleep(float(arguments["s"]))
            return ToolResult("slept")

    calls = "\n".join(f'<tool_call>{{"name": "sleepy", "arguments": {{"s": {s}}}}}</tool_call>' for s in (0.4, 0.4, 0.4, 5))
    started = time.perf_counter()
    trajectory, _ = run_tool_loop(tokenizer, renderer, [calls, "done"], {"tool_timeout_s": 0.8},
                                  tools={"sleepy": (Sleepy(), {})}, response_length=1024)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, f"four calls took {elapsed:.2f} s: not concurrent, or the timeout did not cut the slow one"
    assert trajectory.metrics["tool_calls"] == 4 and trajectory.metrics["tool_timeouts"] == 1
    assert "did not finish within 0.8 s" in response_text(tokenizer, trajectory, sampled=False)


def test_bad_calls_become_error_results_and_the_conversation_goes_on(tokenizer, renderer):
    bad = ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n<tool_call>{broken</tool_call>\n'
           '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    trajectory, _ = run_tool_loop(tokenizer, renderer, [bad, "ok"], response_length=1024)
    text = response_text(tokenizer, trajectory, sampled=False)
    assert "no tool named 'nope'" in text and "not valid JSON" in text and "division by zero" in text.lower()
    assert trajectory.metrics["tool_errors"] == 3 and trajectory.metrics["parse_errors"] == 1
    assert trajectory.num_turns == 2 and trajectory.finish_reason == "stop"


def test_limits_on_parallel_calls_turns_and_response_length(tokenizer, renderer):
    three = "\n".join([CALL] * 3)
    trajectory, _ = run_tool_loop(tokenizer, renderer, [three, "1776"], {"max_parallel_calls": 2}, response_length=1024)
    assert "at most 2 tool calls per turn" in response_text(tokenizer, trajectory, sampled=False)
    trajectory, client = run_tool_loop(tokenizer, renderer, [CALL], {"max_turns": 3}, response_length=1024)
    assert trajectory.num_turns == 3 and client.calls == 3 and trajectory.finish_reason == "max_turns"
    assert trajectory.metrics["tool_calls"] == 2  # the last turn's call is not run
    assert truncate("abcdefghij" * 10, 30, "middle").startswith("abcdef") and len(truncate("x" * 100, 30, "left")) == 30
    big = {"calculator": (CalculatorTool(), {})}
    trajectory, _ = run_tool_loop(tokenizer, renderer, [CALL.replace("37*48", "9" * 40 + "*" + "9" * 40), "x"],
                                  {"max_tool_response_length": 24, "truncate_side": "right"}, tools=big)
    assert "...(truncated)..." in response_text(tokenizer, trajectory, sampled=False)


def test_budget_runs_out_mid_conversation(tokenizer, renderer):
    trajectory, _ = run_tool_loop(tokenizer, renderer, [CALL, "1776"], response_length=len(CALL) + 8)
    assert trajectory.finish_reason == "length" and len(trajectory.response_ids) <= len(CALL) + 8
    trajectory.check(len(CALL) + 8)


def test_rows_choose_their_tools_and_pass_create_kwargs(tokenizer, renderer):
    class Keyed(Tool):
        @classmethod
        def default_schema(cls):
            return {"type": "function", "function": {"name": "keyed", "parameters": {"type": "object"}}}

        async def call(self, arguments, state):
            return ToolResult(f"key={state['key']}")

    tools = {"calculator": CalculatorTool(), "keyed": Keyed()}
    offered = row_tools(tools, {"tools": ["keyed"], "tools_kwargs": {"keyed": {"create_kwargs": {"key": 7}},
                                                                     "calculator": None}}, "row 0")
    assert list(offered) == ["keyed"] and offered["keyed"][1] == {"key": 7}
    assert sorted(row_tools(tools, {}, "row 0")) == ["calculator", "keyed"]
    with pytest.raises(ValueError, match="row 3: extra_info.tools names \\['web'\\]"):
        row_tools(tools, {"tools": ["web"]}, "row 3")
    trajectory, _ = run_tool_loop(tokenizer, renderer, ['<tool_call>{"name": "keyed", "arguments": {}}</tool_call>', "x"],
                                  tools=offered)
    assert "key=7" in response_text(tokenizer, trajectory, sampled=False)


def test_calculator_called_for_a_row_without_it_is_an_unknown_tool(tokenizer, renderer):
    trajectory, _ = run_tool_loop(tokenizer, renderer, [CALL, "x"], tools={})
    assert "no tool named 'calculator'; the tools are: none" in response_text(tokenizer, trajectory, sampled=False)


def test_env_loop_reward_and_feedback(tokenizer, renderer):
    loop = EnvLoop({"max_turns": 3})
    context = context_for(tokenizer, renderer, environment=lambda: RetryEnvironment({}))
    for turns, reward, count in ((["7", "1776"], 1.0, 2), (["7", "8", "9", "1776"], 0.0, 3), (["1776"], 1.0, 1)):
        trajectory = asyncio.run(loop.run(row(), ScriptedClient(tokenizer, turns, stop_id(tokenizer)), context))
        assert trajectory.reward_score == reward and trajectory.num_turns == count
        assert response_text(tokenizer, trajectory, sampled=False).count("wrong, try again") == count - 1


# -- the tools file ---------------------------------------------------------------------------------------

def test_tools_file_builds_registered_and_imported_tools_and_reports_mistakes(tmp_path):
    good = tmp_path / "tools.yaml"
    good.write_text("tools:\n  - name: calculator\n  - name: python\n    config: {wall_seconds: 3}\n"
                    "  - class_name: rlplat_agents.tools.CalculatorTool\n    tool_schema:\n      type: function\n"
                    "      function: {name: calc2, parameters: {type: object}}\n")
    specs = read_tools_file(good)
    assert [spec.build().name for spec in specs] == ["calculator", "python", "calc2"]
    cases = {
        "tools: 3\n": "must hold a list under 'tools'",
        "tools:\n  - name: calculatr\n": "unknown tool 'calculatr'",
        "tools:\n  - name: python\n    config: {wall_secs: 3}\n": "wall_secs",
        "tools:\n  - name: calculator\n  - name: calculator\n": "a second tool named 'calculator'",
        "tools:\n  - class_name: no.such.Module\n": "cannot be imported",
        "tools:\n  - name: calculator\n    tool_schema: {function: {}}\n": "no name",
        "tools:\n  - name: calculator\n    extra: 1\n": "unknown keys ['extra']",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)) as error:
            read_tools_file(bad)
        assert str(bad) in str(error.value)
    with pytest.raises(ConfigError, match="no file at"):
        read_tools_file(tmp_path / "missing.yaml")


# -- a third-party tool through a plugin ----------------------------------------------------------------

class Reverse(Tool):
    """A plugin's tool: reverses its text."""

    @classmethod
    def default_schema(cls):
        return {"type": "function", "function": {"name": "reverse", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    async def call(self, arguments, state):
        text = arguments.get("text")
        if not isinstance(text, str):
            return ToolResult("error: reverse needs 'text'", error=True)
        return ToolResult(text[::-1])


def test_a_plugin_tool_works_through_the_tools_file_and_the_loop(tmp_path, tokenizer, renderer, register_temporary_plugin):
    class Plugin:
        @hookimpl
        def register_tools(self, register):
            register("reverse", Reverse, description="reverses text")

    register_temporary_plugin(Plugin(), name="reverse-tool")
    assert "reverse" in registry.names("tool")
    tools_file = tmp_path / "tools.yaml"
    tools_file.write_text("tools:\n  - name: reverse\n")
    tool = read_tools_file(tools_file)[0].build()
    call = '<tool_call>{"name": "reverse", "arguments": {"text": "abc"}}</tool_call>'
    trajectory, _ = run_tool_loop(tokenizer, renderer, [call, "cba"], tools={"reverse": (tool, {})})
    assert "<tool_response>\ncba\n</tool_response>" in response_text(tokenizer, trajectory, sampled=False)


# -- the manager ----------------------------------------------------------------------------------------

class ReactiveClient:
    """Calls the calculator until the conversation holds a tool response, then answers; counts requests
    in flight over all its siblings (``shared``) and remembers the prompts it saw."""

    def __init__(self, tokenizer, shared):
        self.tokenizer, self.shared, self.prompts = tokenizer, shared, []
        self.response_id = tokenizer.convert_tokens_to_ids("<tool_response>")

    async def generate(self, prompt_ids, sampling):
        self.shared["now"] += 1
        self.shared["most"] = max(self.shared["most"], self.shared["now"])
        self.prompts.append(tuple(prompt_ids))
        try:
            await asyncio.sleep(0.002)
            text = "1776" if self.response_id in prompt_ids else CALL
            return await ScriptedClient(self.tokenizer, [text], stop_id(self.tokenizer)).generate(prompt_ids, sampling)
        finally:
            self.shared["now"] -= 1


def prompt_batch(tokenizer, renderer, count=6, agent_name=None):
    rows = []
    for index in range(count):
        messages = [{"role": "user", "content": f"{index}*7="}]
        rows.append({"input_ids": renderer.prompt_ids(messages), "raw_prompt": messages, "data_source": "t",
                     "reward_model": {"ground_truth": str(index * 7)}, "extra_info": {}, "index": index,
                     **({"agent_name": agent_name} if agent_name else {})})
    return collate(rows, tokenizer.pad_token_id)


def test_manager_returns_generates_keys_with_masks_and_metrics(tokenizer, renderer):
    shared = {"now": 0, "most": 0}
    clients = [ReactiveClient(tokenizer, shared) for _ in range(2)]
    manager = AgentLoopManager(clients, tokenizer, AgentConfig(loop="tool", max_concurrency=3),
                               pad_token_id=tokenizer.pad_token_id, max_prompt_length=1024,
                               tools={"calculator": CalculatorTool()})
    prompts = prompt_batch(tokenizer, renderer, 4)
    out = manager.generate(prompts, SamplingParams(n=2), response_length=120)
    assert len(out) == 8 and out.batch["prompts"].shape == (8, 1024) and out.batch["responses"].shape == (8, 120)
    mask, attention = out.batch["response_mask"], out.batch["attention_mask"][:, 1024:]
    assert bool((mask <= attention).all()) and int(mask.sum()) < int(attention.sum())
    assert bool((out.batch["rollout_log_probs"][mask == 0] == 0).all())
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))
    assert list(out.non_tensor_batch["uid"]) == [uid for uid in prompts.non_tensor_batch["uid"] for _ in range(2)]
    assert np.isnan(out.non_tensor_batch["agent_reward"]).all()
    assert shared["most"] == 3, "not agent.max_concurrency conversations in flight at once"
    assert all(c.prompts for c in clients), "least in-flight placement left a replica idle"
    metrics = agent_metrics(out)
    assert metrics["agent/turns/mean"] == 2 and metrics["agent/tool_call_rate"] == 1.0 and metrics["agent/tool_error_rate"] == 0


def test_conversations_stay_on_their_replica(tokenizer, renderer):
    clients = [ReactiveClient(tokenizer, {"now": 0, "most": 0}) for _ in range(3)]
    manager = AgentLoopManager(clients, tokenizer, AgentConfig(loop="tool"), pad_token_id=tokenizer.pad_token_id,
                               max_prompt_length=1024, tools={"calculator": CalculatorTool()})
    manager.generate(prompt_batch(tokenizer, renderer, 9), SamplingParams(), response_length=120)
    for client in clients:  # every second turn's prompt extends a first turn's prompt seen by the same replica
        firsts = [p for p in client.prompts if not any(len(q) < len(p) and p[:len(q)] == q for q in client.prompts)]
        seconds = [p for p in client.prompts if p not in firsts]
        assert len(firsts) == len(seconds) == 3 and all(any(s[:len(f)] == f for f in firsts) for s in seconds)


def test_manager_errors_name_the_row(tokenizer, renderer):
    manager = AgentLoopManager([ScriptedClient(tokenizer, ["x"], stop_id(tokenizer))], tokenizer, AgentConfig(),
                               pad_token_id=tokenizer.pad_token_id, max_prompt_length=200)
    with pytest.raises(ValueError, match="row 0 .*no agent_name and agent.loop is not set"):
        manager.generate(prompt_batch(tokenizer, renderer, 2), SamplingParams(), response_length=8)
    small = AgentLoopManager([ScriptedClient(tokenizer, ["x"], stop_id(tokenizer))], tokenizer,
                             AgentConfig(loop="tool"), pad_token_id=tokenizer.pad_token_id, max_prompt_length=10,
                             tools={"calculator": CalculatorTool()})
    with pytest.raises(ValueError, match="raise agent.max_prompt_length"):
        small.generate(prompt_batch(tokenizer, renderer, 1), SamplingParams(), response_length=8)
    verl = AgentLoopManager([ScriptedClient(tokenizer, ["x"], stop_id(tokenizer))], tokenizer, AgentConfig(),
                            pad_token_id=tokenizer.pad_token_id, max_prompt_length=200)
    out = verl.generate(prompt_batch(tokenizer, renderer, 2, agent_name="single_turn_agent"), SamplingParams(), 8)
    assert len(out) == 2


def test_env_rewards_reach_the_batch(tokenizer, renderer):
    manager = AgentLoopManager([ScriptedClient(tokenizer, ["5", "1776"], stop_id(tokenizer))], tokenizer,
                               AgentConfig(loop="env", environment="retry"), pad_token_id=tokenizer.pad_token_id,
                               max_prompt_length=200)
    prompts = prompt_batch(tokenizer, renderer, 1)
    prompts.non_tensor_batch["reward_model"] = np.array([{"ground_truth": "1776"}], dtype=object)
    out = manager.generate(prompts, SamplingParams(), response_length=64)
    assert out.non_tensor_batch["agent_reward"].tolist() == [1.0]
    assert agent_metrics(out)["agent/turns/mean"] == 2


# -- data and config --------------------------------------------------------------------------------------

def verl_rows():
    return [{"data_source": "t", "prompt": [{"role": "user", "content": f"{a}*3="}],
             "reward_model": {"ground_truth": str(3 * a)}, "agent_name": "tool_agent",
             "extra_info": {"index": a, "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(3 * a)}}}}}
            for a in range(4)]


def test_verl_multi_turn_rows_load_unchanged_and_run_through_the_manager(tmp_path, tokenizer, renderer):
    from rlplat.data import RLDataset
    from rlplat.kits.data import write_parquet

    path = write_parquet(verl_rows(), tmp_path / "train.parquet")
    dataset = RLDataset([path], tokenizer, max_prompt_length=64)
    batch = collate([dataset[i] for i in range(len(dataset))], tokenizer.pad_token_id)
    assert list(batch.non_tensor_batch["agent_name"]) == ["tool_agent"] * 4
    assert batch.non_tensor_batch["extra_info"][1]["tools_kwargs"]["calculator"]["create_kwargs"] == {"ground_truth": "3"}
    manager = AgentLoopManager([ReactiveClient(tokenizer, {"now": 0, "most": 0})], tokenizer, AgentConfig(),
                               pad_token_id=tokenizer.pad_token_id, max_prompt_length=1024,
                               tools={"calculator": CalculatorTool()})
    out = manager.generate(batch, SamplingParams(), response_length=128)
    assert agent_metrics(out)["agent/turns/mean"] == 2
    bad = [{**row, "agent_name": 5} for row in verl_rows()]
    write_parquet(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet, row 0, column 'agent_name'"):
        RLDataset([str(tmp_path / "bad.parquet")], tokenizer, max_prompt_length=64)


@pytest.fixture
def chat_model(tmp_path_factory):
    """A tiny model directory whose tokenizer has the ChatML tools template."""
    from rlplat.testing.chat_tokenizers import save_chat_tokenizer
    from rlplat.testing.tiny_models import tiny_causal_lm

    directory = tmp_path_factory.mktemp("chat-model")
    save_chat_tokenizer(directory, CHATML_TOOLS)
    size = len(chat_tokenizer(CHATML_TOOLS))
    tiny_causal_lm(vocab_size=size, pad_token_id=0, bos_token_id=None, eos_token_id=None).save_pretrained(directory)
    return directory


def test_agent_config_is_checked_at_load(tmp_path, chat_model):
    import rlplat_demo as demo
    from rlplat.config import load_config
    from rlplat.kits.data import write_parquet

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calculator\n")
    train = write_parquet(verl_rows(), tmp_path / "train.parquet")
    base = [f"model.path={chat_model}", f"data.train_files=[{train}]", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "cluster.backend=local"]
    config = load_config(None, base + [f"agent.tools_config={tools}", "agent.max_prompt_length=1024"])
    assert config.agent.tools_config == str(tools)
    cases = {
        "the tool agent loop offers the tools of agent.tools_config": base,
        "unknown config key 'agent.loops.tool.max_turn'. Did you mean 'agent.loops.tool.max_turns'": base + [f"agent.tools_config={tools}", "agent.loops.tool.max_turn=3"],
        "unknown agent_loop 'tools'": base + [f"agent.tools_config={tools}", "agent.loop=tools"],
        "the env agent loop needs an environment": base + [f"agent.tools_config={tools}", "agent.loop=env"],
        "unknown tool_parser 'hermez'": base + [f"agent.tools_config={tools}", "agent.tool_parser=hermez"],
        "unknown config key 'agent.environment_config.feedbak'": base + [f"agent.tools_config={tools}", "agent.environment=retry",
                                               "agent.environment_config.feedbak=no"],
        "agent.environment_config is set but agent.environment is not": base + [f"agent.tools_config={tools}",
                                                                               "agent.environment_config.feedback=no"],
        "max_concurrency must be >= 1": base + [f"agent.tools_config={tools}", "agent.max_concurrency=0"],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, overrides)
    no_template = [f"model.path={demo.model_dir()}", f"data.train_files=[{demo.train_file()}]", "agent.loop=env",
                   "agent.environment=retry", "cluster.backend=local"]
    with pytest.raises(ConfigError, match="has none .only the single_turn loop works without one"):
        load_config(None, no_template)
    assert load_config(None, no_template[:2] + ["agent.loop=single_turn", "cluster.backend=local"]).agent.loop == "single_turn"
    unknown = tmp_path / "unknown.parquet"
    rows = verl_rows()
    rows[0]["agent_name"] = "browser"
    write_parquet(rows, unknown)
    with pytest.raises(ConfigError, match="the agent_name 'browser' in data.train_files: unknown agent_loop 'browser'"):
        load_config(None, base[:1] + [f"data.train_files=[{unknown}]", f"agent.tools_config={tools}"] + base[2:])
