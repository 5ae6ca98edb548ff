"""Tools written for verl (its ``BaseTool`` shape) named by ``class_name`` in the tools file: built as verl
builds them, run through the tool loop (the row's ``create_kwargs`` reach ``create``, ``execute``'s answer,
step reward and metrics reach the result, ``release`` ends each conversation), and a class of neither shape
refused at load by name."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from rlplat_agents.chat import ChatRenderer
from rlplat_agents.loops import ToolLoop
from rlplat_agents.parsers import HermesParser
from rlplat_agents.tools import ToolSchema, VerlToolAdapter, read_tools_file, response_text, row_tools
from rlplat.config_node import ConfigError
from rlplat.contracts.agent import AgentContext
from rlplat.contracts.rollout import SamplingParams
from rlplat.testing import ScriptedClient
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, chat_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "verl_gsm8k_multiturn"
TOOLS_FILE = FIXTURES / "gsm8k_tool_config.yaml"


def call(answer: str) -> str:
    return f'<tool_call>\n{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{answer}"}}}}\n</tool_call>'


@pytest.fixture(autouse=True)
def user_module(monkeypatch):
    """The user's tool module is importable, as a verl user's is on their PYTHONPATH."""
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(CHATML_TOOLS)


def tools_file(tmp_path: Path, log_path: Path | None = None, **entry_changes) -> Path:
    """verl's gsm8k tools file with ``config.log_path`` (and other entry keys) set."""
    import yaml

    content = yaml.safe_load(TOOLS_FILE.read_text())
    entry = content["tools"][0]
    if log_path is not None:
        entry["config"]["log_path"] = str(log_path)
    entry.update(entry_changes)
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(content))
    return path


def gsm8k_row(ground_truth: str) -> dict:
    """A row of verl's gsm8k multi-turn data (examples/data_preprocess/gsm8k_multiturn_w_tool.py's schema)."""
    return {"raw_prompt": [{"role": "system", "content": "Use calc_gsm8k_reward."},
                           {"role": "user", "content": "Ann has 3 pens and buys 4. How many?"}],
            "data_source": "openai/gsm8k", "agent_name": "tool_agent", "uid": "u0",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": ground_truth}}}}}


def run_conversation(tokenizer, tool, row: dict, turns: list[str]):
    renderer = ChatRenderer(tokenizer)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    context = AgentContext(tokenizer=tokenizer, renderer=renderer, sampling=SamplingParams(), response_length=512,
                           prompt_ids=renderer.prompt_ids(row["raw_prompt"]),
                           tools=row_tools({tool.name: tool}, row["extra_info"], "row 0"), parser=HermesParser(),
                           stop_token_ids=renderer.stop_token_ids)
    trajectory = asyncio.run(ToolLoop({"max_turns": 4}).run(row, ScriptedClient(tokenizer, turns, stop), context))
    context_text = tokenizer.decode([t for t, m in zip(trajectory.response_ids, trajectory.response_mask) if not m])
    return trajectory, context_text


def lifecycle(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_path.read_text().splitlines()]


# -- built from the tools file ------------------------------------------------------------------------------

def test_a_verl_shaped_class_is_built_as_verl_builds_it(tmp_path):
    specs = read_tools_file(tools_file(tmp_path))
    tool = specs[0].build()
    assert isinstance(tool, VerlToolAdapter) and tool.name == "calc_gsm8k_reward"
    verl_tool = tool.verl_tool
    assert verl_tool.config == {"type": "native"}
    assert verl_tool.tool_schema.function.parameters.required == ["answer"]  # attribute access, as pydantic gives
    assert verl_tool.tool_schema.model_dump()["function"]["name"] == "calc_gsm8k_reward"
    assert tool.schema == verl_tool.tool_schema.model_dump()  # what the model is offered: the file's schema


def test_the_schema_object_reads_by_key_and_by_attribute_and_names_what_is_missing():
    schema = ToolSchema({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
    assert schema.function.name == schema["function"]["name"] == "f" and schema.function.parameters.type == "object"
    with pytest.raises(AttributeError, match="the tool schema has no 'description'"):
        schema.function.description


# -- one conversation through the tool loop ------------------------------------------------------------------

def test_create_gets_the_rows_create_kwargs_execute_grades_and_release_ends_the_conversation(tmp_path, tokenizer):
    log = tmp_path / "tool.jsonl"
    tool = read_tools_file(tools_file(tmp_path, log))[0].build()
    trajectory, context_text = run_conversation(tokenizer, tool, gsm8k_row("7"), [call("6"), call("7"), "#### 7"])
    assert trajectory.num_turns == 3 and trajectory.finish_reason == "stop"
    events = lifecycle(log)
    assert [event["event"] for event in events] == ["create", "execute", "execute", "release"]
    assert events[0]["ground_truth"] == "7"  # extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs
    assert len({event["instance_id"] for event in events}) == 1  # one instance for the whole conversation
    assert "answer '6' scores 0.0" in context_text and "answer '7' scores 1.0" in context_text
    # step rewards: -0.05 for the first answer (no better than 0), 0.0 for the improving second
    assert trajectory.metrics["tool_reward"] == pytest.approx(-0.05)
    assert trajectory.metrics["tool_calls"] == 2 and trajectory.metrics["tool_errors"] == 0
    assert tool.verl_tool.instances == {}


def test_execute_reward_and_numeric_metrics_reach_the_tool_result(tmp_path):
    tool = read_tools_file(tools_file(tmp_path))[0].build()

    async def one_call():
        state = await tool.open({"ground_truth": "42"})
        try:
            return await tool.call({"answer": "42"}, state)
        finally:
            await tool.close(state)

    result = asyncio.run(one_call())
    assert (result.text, result.reward, result.error) == ("answer '42' scores 1.0", 0.0, False)
    assert result.metrics == {"score": 1.0}  # the string metric "note" is not a number: dropped


def test_release_comes_also_when_the_conversation_fails(tmp_path, tokenizer):
    log = tmp_path / "tool.jsonl"
    tool = read_tools_file(tools_file(tmp_path, log))[0].build()

    class Broken:
        async def generate(self, prompt_ids, sampling):
            raise RuntimeError("the rollout died")

    renderer = ChatRenderer(tokenizer)
    row = gsm8k_row("7")
    context = AgentContext(tokenizer=tokenizer, renderer=renderer, sampling=SamplingParams(), response_length=64,
                           prompt_ids=renderer.prompt_ids(row["raw_prompt"]),
                           tools=row_tools({tool.name: tool}, row["extra_info"], "row 0"), parser=HermesParser(),
                           stop_token_ids=renderer.stop_token_ids)
    with pytest.raises(RuntimeError, match="the rollout died"):
        asyncio.run(ToolLoop({}).run(row, Broken(), context))
    assert [event["event"] for event in lifecycle(log)] == ["create", "release"]


def test_create_kwargs_reach_create_as_keywords_and_as_verls_tool_agent_loop_passes_them():
    from rlplat_agents.tools import create_arguments

    async def sglang_style(instance_id=None, ground_truth=None):
        pass

    async def agent_loop_style(instance_id=None, create_kwargs=None):
        pass

    async def either(instance_id=None, **kwargs):
        pass

    row = {"ground_truth": "7"}
    assert create_arguments(sglang_style, row) == {"ground_truth": "7"}
    assert create_arguments(agent_loop_style, row) == {"create_kwargs": {"ground_truth": "7"}}
    assert create_arguments(either, row) == {"ground_truth": "7", "create_kwargs": {"ground_truth": "7"}}


def test_a_tool_of_verl_before_0_5_returns_an_id_and_a_string(tmp_path):
    path = tools_file(tmp_path, class_name="verl_style_tools.OldStyleTool",
                      tool_schema={"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}})
    tool = read_tools_file(path)[0].build()

    async def one_call():
        state = await tool.open({})
        result = await tool.call({"text": "hi"}, state)
        await tool.close(state)
        return state, result

    state, result = asyncio.run(one_call())
    assert (result.text, result.reward, result.metrics) == ("echo hi", 0.5, {})
    assert tool.verl_tool.created == tool.verl_tool.released == [state]


@pytest.mark.parametrize("response, text", [
    ("plain", "plain"),
    (None, ""),
    ({"text": "from a dict"}, "from a dict"),
    ({"text": "look", "image": ["a", "b"]}, "look\n[the tool also returned 2 image(s), which a text conversation cannot show]"),
    ({"video": ["v"]}, "[the tool also returned 1 video(s), which a text conversation cannot show]"),
])
def test_verls_tool_responses_become_the_tool_messages_text(response, text):
    from verl_style_tools import ToolResponse

    assert response_text(response) == text
    if isinstance(response, dict):
        assert response_text(ToolResponse(**response)) == text


# -- refused at load --------------------------------------------------------------------------------------------

def test_a_class_of_neither_shape_is_refused_naming_the_entry_and_both_shapes(tmp_path):
    path = tools_file(tmp_path, class_name="verl_style_tools.NotQuiteATool")
    with pytest.raises(ConfigError) as raised:
        read_tools_file(path)
    message = str(raised.value)
    assert message.startswith(f"agent.tools_config: {path}, tools[0] (calc_gsm8k_reward): class_name "
                              "'verl_style_tools.NotQuiteATool' (a class without async release) is neither an rlplat tool")
    assert "rlplat.contracts.agent.Tool" in message and "verl (its BaseTool shape: __init__(self, config, tool_schema)" in message


@pytest.mark.parametrize("class_name, says", [
    ("verl_style_tools.last_number", "(a function) is neither"),
    ("json.JSONDecoder", "(a class without __init__(self, config, tool_schema), async create, async execute, async release)"),
])
def test_other_things_at_class_name_are_refused_too(tmp_path, class_name, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        read_tools_file(tools_file(tmp_path, class_name=class_name))


def test_a_module_that_fails_to_import_is_named_by_its_entry(tmp_path, monkeypatch):
    (tmp_path / "broken_tools.py").write_text("raise RuntimeError('the module needs a service')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape("class_name 'broken_tools.Tool' cannot be imported: RuntimeError: "
                                                    "the module needs a service")):
        read_tools_file(tools_file(tmp_path, class_name="broken_tools.Tool"))


def test_an_mcp_tool_is_refused_and_a_failing_constructor_is_named(tmp_path):
    path = tools_file(tmp_path)
    path.write_text(path.read_text().replace("type: native", "type: mcp"))
    with pytest.raises(ConfigError, match="config.type 'mcp': rlplat builds native tools only"):
        read_tools_file(path)
    no_schema = tools_file(tmp_path)
    no_schema.write_text("tools:\n  - class_name: verl_style_tools.Gsm8kAnswerTool\n    config: {type: native}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{no_schema}, tools[0]: building the tool raised AttributeError")):
        read_tools_file(no_schema)


def test_a_refused_class_ends_the_command_with_exit_2_and_one_line(tmp_path, cli_in_process):
    from rlplat_demo import tools as tool_demo

    path = tools_file(tmp_path, class_name="verl_style_tools.NotQuiteATool")
    result = cli_in_process("config", "show", f"model.path={tool_demo.model_dir()}", "agent.loop=tool",
                            f"data.train_files=[{tool_demo.data_file('train')}]", f"agent.tools_config={path}")
    assert result.returncode == 2
    assert result.stderr.startswith("rlplat: config error: agent.tools_config: ") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
