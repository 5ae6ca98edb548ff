"""The OpenAI-compatible gateway and the blackbox loop on the tool demo's model through the real hf rollout,
driven by the stock ``openai`` client: recorded tokens equal sampled tokens, prefix breaks split (or are
refused), bad requests get OpenAI error bodies, and agents that crash or hang cost their row only."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time

import numpy as np
import openai
import pytest
import requests
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.data import RLDataset, collate
from rlplat_agents.config import AgentConfig, GatewayConfig
from rlplat_agents.manager import AgentLoopManager, EngineClient, agent_metrics
from rlplat_demo import tools as tool_demo

RESPONSE_LENGTH = 80
SAMPLING = SamplingParams(temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def engine():
    from rlplat_rollout_hf.rollout import HFRollout

    return HFRollout({"model_path": str(tool_demo.model_dir()), "dtype": "float32"})


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_demo.model_dir()))


def make_manager(engine, tokenizer, **agent):
    config = AgentConfig(**agent)
    return AgentLoopManager([EngineClient(engine)], tokenizer, config, pad_token_id=tokenizer.pad_token_id,
                            max_prompt_length=64)


@pytest.fixture
def gateway(engine, tokenizer):
    manager = make_manager(engine, tokenizer)
    manager.policy_version = lambda: 3
    gateway = manager.gateway_for(SAMPLING, RESPONSE_LENGTH)
    yield manager, gateway
    manager.close()


def client_for(url, key="unused"):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def mask_runs(mask):
    runs, start = [], None
    for index, value in enumerate([*mask, 0]):
        if value and start is None:
            start = index
        elif not value and start is not None:
            runs.append((start, index))
            start = None
    return runs


def three_turn_conversation(client):
    """The client's side of a tool conversation: a question with the calculator offered, the model's calls
    answered as tool messages (a user message when it made none), three model turns."""
    messages = [{"role": "user", "content": "37*48="}]
    replies = []
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[tool_demo.TOOL_SCHEMA],
                                               logprobs=True)
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "1776"})
        else:
            messages.append({"role": "user", "content": "and 12*12="})
    return messages, replies


def test_openai_client_three_tool_turns_record_exactly_the_sampled_tokens(gateway, engine, tokenizer):
    manager, gateway = gateway
    session = gateway.open(manager.replicas.sticky(), SAMPLING)
    _, replies = three_turn_conversation(client_for(gateway.base_url(session.id)))
    closed = gateway.close(session.id)
    assert len(closed.segments) == 1 and closed.prefix_breaks == 0
    segment = closed.segments[0]
    builder = segment.builder
    runs = mask_runs(builder.response_mask)
    assert len(runs) == 3 and segment.calls == 3
    # Each call's tokens again, straight from generate_tokens after the same prefix with the same seed.
    for call, ((start, end), reply) in enumerate(zip(runs, replies)):
        prefix = builder.prompt_ids + builder.response_ids[:start]
        sampling = SamplingParams(temperature=1.0, seed=SAMPLING.seed + 7_919 * call, n=1,
                                  max_new_tokens=RESPONSE_LENGTH - start,
                                  stop_token_ids=tuple(sorted(set(gateway.stop_token_ids))))
        direct = asyncio.run(engine.generate_tokens(prefix, sampling))
        assert builder.response_ids[start:end] == direct.token_ids
        recorded = np.asarray(builder.rollout_log_probs[start:end])
        assert np.abs(recorded - np.asarray(direct.log_probs)).max() <= 1e-6
        returned = [item.logprob for item in reply.choices[0].logprobs.content]
        assert np.abs(np.asarray(returned) - recorded).max() <= 1e-6
    # Tokens between the model's turns are the template's, never sampled; versions only on sampled tokens.
    assert sum(builder.response_mask) == sum(end - start for start, end in runs)
    assert [3 if keep else -1 for keep in builder.response_mask] == segment.versions
    text = tokenizer.decode(builder.prompt_ids + builder.response_ids, skip_special_tokens=False)
    assert text.count("<|im_start|>assistant") == 3 and "<tools>calculator</tools>" in text


def test_a_rewritten_history_splits_and_is_counted_never_merged(gateway, tokenizer):
    manager, gateway = gateway
    session = gateway.open(manager.replicas.sticky(), SAMPLING)
    client = client_for(gateway.base_url(session.id))
    messages = [{"role": "user", "content": "12*12="}]
    first = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    # the scaffold edits the assistant's turn before sending it back (as `false` -> `False` would)
    edited = {"role": "assistant", "content": (first.content or "") + " (edited)"}
    client.chat.completions.create(model="policy", messages=[*messages, edited, {"role": "user", "content": "again"}])
    closed = gateway.close(session.id)
    assert closed.prefix_breaks == 1 and len(closed.segments) == 2
    first_segment, second = closed.segments
    # the second segment starts from the rewritten history's rendering: its prompt holds the edit, masked out
    assert "(edited)" in tokenizer.decode(second.builder.prompt_ids)
    assert sum(first_segment.builder.response_mask) == len(first_segment.builder.response_ids)
    assert "(edited)" not in tokenizer.decode(first_segment.builder.response_ids)


def test_a_reserialised_tool_call_is_a_prefix_break(gateway):
    manager, gateway = gateway
    # a conversation whose first turn is a call: replayed until the model makes one (the warm start calls
    # the calculator on about one question in ten)
    for attempt in range(40):
        sampling = SamplingParams(temperature=1.0, seed=100 + attempt)
        session = gateway.open(manager.replicas.sticky(), sampling)
        client = client_for(gateway.base_url(session.id))
        messages = [{"role": "user", "content": "37*48="}]
        message = client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[tool_demo.TOOL_SCHEMA]).choices[0].message
        if message.tool_calls:
            break
        gateway.close(session.id)
    else:
        pytest.fail("the tool demo's model made no tool call in 40 tries")
    sent = message.model_dump(exclude_none=True)
    for call in sent["tool_calls"]:  # the scaffold parses and re-serialises the arguments
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=1)
    client.chat.completions.create(model="policy", tools=[tool_demo.TOOL_SCHEMA], messages=[
        *messages, sent, {"role": "tool", "tool_call_id": sent["tool_calls"][0]["id"], "content": "1776"}])
    closed = gateway.close(session.id)
    assert closed.prefix_breaks == 1 and len(closed.segments) == 2


def test_on_prefix_break_error_refuses_the_request(engine, tokenizer):
    manager = make_manager(engine, tokenizer, gateway=GatewayConfig(on_prefix_break="error"))
    try:
        gateway = manager.gateway_for(SAMPLING, RESPONSE_LENGTH)
        session = gateway.open(manager.replicas.sticky(), SAMPLING)
        client = client_for(gateway.base_url(session.id))
        messages = [{"role": "user", "content": "12*12="}]
        client.chat.completions.create(model="policy", messages=messages)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="policy", messages=[
                *messages, {"role": "assistant", "content": "False"}, {"role": "user", "content": "again"}])
        assert refused.value.code == "prefix_break"
        closed = gateway.close(session.id)
        assert closed.prefix_breaks == 1 and len(closed.segments) == 1
    finally:
        manager.close()


def test_requests_without_a_session_find_theirs_by_longest_prefix(gateway):
    manager, gateway = gateway
    tasks = [[{"role": "user", "content": f"{a}*{b}="}] for a, b in ((12, 13), (40, 41))]
    sessions = [gateway.open(manager.replicas.sticky(), SAMPLING, task_messages=task) for task in tasks]
    client = client_for(gateway.base_url())  # no session in the address
    histories = []
    for task in tasks:
        message = client.chat.completions.create(model="policy", messages=task).choices[0].message
        histories.append([*task, message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}])
    for history in reversed(histories):
        client.chat.completions.create(model="policy", messages=history)
    for session, task in zip(sessions, tasks):
        closed = gateway.close(session.id)
        assert closed.calls == 2 and closed.prefix_breaks == 0 and len(closed.segments) == 1
        assert task[0]["content"] in manager.tokenizer.decode(closed.segments[0].builder.prompt_ids)
    # a request that continues no session starts an unattributed one, which trains nothing
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "99*99="}])
    assert gateway.sweep() == 1 and gateway.sweep() == 0
    assert not gateway.sessions


def test_completions_record_and_extend_a_text_session(gateway, tokenizer):
    manager, gateway = gateway
    session = gateway.open(manager.replicas.sticky(), SAMPLING)
    client = client_for(gateway.base_url(session.id))
    first = client.completions.create(model="policy", prompt="12*12=", max_tokens=6, logprobs=1)
    text = "12*12=" + first.choices[0].text + "\n3*3="
    client.completions.create(model="policy", prompt=text, max_tokens=6)
    closed = gateway.close(session.id)
    assert len(closed.segments) == 1 and closed.segments[0].calls == 2
    builder = closed.segments[0].builder
    assert tokenizer.decode(builder.prompt_ids) == "12*12="
    assert first.choices[0].logprobs.token_logprobs == pytest.approx(
        builder.rollout_log_probs[: len(first.choices[0].logprobs.token_logprobs)], abs=1e-6)


def test_bad_requests_get_openai_error_bodies(gateway, engine, tokenizer):
    manager, gateway = gateway
    session = gateway.open(manager.replicas.sticky(), SAMPLING)
    url = gateway.base_url(session.id)
    post = lambda path, body, **kw: requests.post(url + path, data=body if isinstance(body, str) else json.dumps(body),
                                                  timeout=30, **kw)
    cases = {
        "not json": ("{", 400, None),
        "no messages": ({"model": "p"}, 400, None),
        "bad role": ({"messages": [{"role": "robot", "content": "x"}]}, 400, None),
        "stream": ({"messages": [{"role": "user", "content": "x"}], "stream": True}, 400, None),
        "n": ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, None),
        "unknown key": ({"messages": [{"role": "user", "content": "x"}], "temprature": 1}, 400, "unsupported_parameter"),
        "max_tokens": ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, None),
        "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        "long prompt": ({"messages": [{"role": "user", "content": "1" * 200}]}, 400, "context_length_exceeded"),
        "multi-token stop": ({"messages": [{"role": "user", "content": "x"}], "stop": ["ab"]}, 400, None),
    }
    for name, (body, status, code) in cases.items():
        response = post("/chat/completions", body)
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", name
        if code is not None:
            assert error["code"] == code, (name, error)
    assert requests.get(url + "/nothing", timeout=30).status_code == 404
    assert gateway.close(session.id).calls == 0
    closed = post("/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert closed.status_code == 410 and closed.json()["error"]["code"] == "session_closed"


def test_a_key_is_required_beyond_loopback_and_checked_when_set(engine, tokenizer):
    with pytest.raises(ValueError, match="api_key"):
        GatewayConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="on_prefix_break"):
        GatewayConfig(on_prefix_break="merge")
    with pytest.raises(ValueError, match="port"):
        GatewayConfig(port=70000)
    manager = make_manager(engine, tokenizer, gateway=GatewayConfig(api_key="s3cret"))
    try:
        gateway = manager.gateway_for(SAMPLING, RESPONSE_LENGTH)
        session = gateway.open(manager.replicas.sticky(), SAMPLING)
        messages = [{"role": "user", "content": "2*3="}]
        with pytest.raises(openai.AuthenticationError):
            client_for(gateway.base_url(session.id), "wrong").chat.completions.create(model="p", messages=messages)
        client_for(gateway.base_url(session.id), "s3cret").chat.completions.create(model="p", messages=messages)
        assert gateway.close(session.id).calls == 1
    finally:
        manager.close()


# -- the blackbox loop --------------------------------------------------------------------------------------

def tool_prompts(tokenizer, count):
    dataset = RLDataset([str(tool_demo.data_file("val"))], tokenizer, max_prompt_length=32)
    return collate([dataset[i] for i in range(count)], tokenizer.pad_token_id)


async def async_agent(task, base_url, api_key, **kwargs):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="policy", messages=task["raw_prompt"])
    return {"reward": float(len(reply.choices[0].message.content or "") % 2), "metrics": {"seen": 1.0}}


def crashing_agent(task, base_url, api_key, **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=task["raw_prompt"])
    raise RuntimeError("the scaffold broke")


def hanging_agent(task, base_url, api_key, **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=task["raw_prompt"])
    time.sleep(3)


def test_blackbox_rows_mask_sampled_tokens_and_carry_versions(engine, tokenizer):
    from rlplat_agents.config import TemplateCheckConfig

    manager = make_manager(engine, tokenizer, loop="blackbox", loop_names={"tool": "blackbox"}, loops={"blackbox": {
        "agent": "rlplat_demo.agents:calculator_agent", "agent_kwargs": {"max_turns": 2}}},
        template_check=TemplateCheckConfig(sample_rate=1.0))
    manager.policy_version = lambda: 7
    try:
        batch = manager.generate(tool_prompts(tokenizer, 8), SamplingParams(n=4, temperature=1.0, seed=2), 40)
    finally:
        manager.close()
    assert len(batch) == 32
    metrics = agent_metrics(batch)
    assert metrics["agent/agent_errors/mean"] == 0 and metrics["agent/calls/mean"] >= 1
    mask, versions = batch.batch["response_mask"], batch.batch["policy_version"]
    assert bool(((versions == 7) == mask.bool()).all())  # 7 exactly on sampled tokens, -1 elsewhere
    assert int(mask.sum()) == int(np.sum(batch.non_tensor_batch["agent/model_tokens"]))
    assert np.isnan(batch.non_tensor_batch["agent_reward"]).all()  # the agent left the reward to the manager
    # the gateway's trajectories are checked against the chat template like the tool loop's: none drift
    assert metrics["agent/template_checked"] > 0 and metrics["agent/template_drifted"] == 0


def test_async_agents_rewards_and_metrics_reach_the_batch(engine, tokenizer):
    manager = make_manager(engine, tokenizer, loop="blackbox", loop_names={"tool": "blackbox"}, loops={"blackbox": {"agent": f"{__name__}:async_agent"}})
    try:
        batch = manager.generate(tool_prompts(tokenizer, 4), SamplingParams(n=2, temperature=1.0, seed=2), 40)
    finally:
        manager.close()
    rewards = batch.non_tensor_batch["agent_reward"]
    assert set(rewards.tolist()) <= {0.0, 1.0} and (batch.non_tensor_batch["agent/seen"] == 1.0).all()


@pytest.mark.parametrize("agent, timeout_s, column", [("crashing_agent", 60.0, "agent_errors"),
                                                       ("hanging_agent", 1.0, "agent_timeouts")])
def test_an_agent_that_crashes_or_hangs_costs_its_row_only(engine, tokenizer, agent, timeout_s, column):
    manager = make_manager(engine, tokenizer, loop="blackbox", loop_names={"tool": "blackbox"}, loops={"blackbox": {
        "agent": f"{__name__}:{agent}", "timeout_s": timeout_s}})
    try:
        batch = manager.generate(tool_prompts(tokenizer, 3), SamplingParams(n=2, temperature=1.0, seed=2), 40)
    finally:
        manager.close()
    assert (batch.non_tensor_batch[f"agent/{column}"] == 1.0).all()
    assert int(batch.batch["response_mask"].sum()) == 0 and (batch.non_tensor_batch["agent_reward"] == 0.0).all()
    assert (batch.non_tensor_batch["agent_finish"] == "error").all()


def test_a_command_agent_gets_the_task_and_the_endpoint(engine, tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import openai
        task = json.load(sys.stdin)
        client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        reply = client.chat.completions.create(model="policy", messages=task["raw_prompt"])
        print("log line")
        print(json.dumps({"reward": 0.25, "metrics": {"kwarg": json.loads(os.environ["RLPLAT_AGENT_KWARGS"])["k"]}}))
    """))
    manager = make_manager(engine, tokenizer, loop="blackbox", loop_names={"tool": "blackbox"}, loops={"blackbox": {
        "command": [sys.executable, str(script)], "agent_kwargs": {"k": 3}}})
    try:
        batch = manager.generate(tool_prompts(tokenizer, 2), SamplingParams(n=2, temperature=1.0, seed=2), 40)
    finally:
        manager.close()
    assert (batch.non_tensor_batch["agent_reward"] == 0.25).all() and (batch.non_tensor_batch["agent/kwarg"] == 3).all()
    assert int(batch.batch["response_mask"].sum()) > 0


def test_blackbox_config_is_checked_at_load():
    from rlplat_agents.blackbox import BlackBoxConfig, load_function

    with pytest.raises(ValueError, match="exactly one"):
        BlackBoxConfig()
    with pytest.raises(ValueError, match="pkg.module:function"):
        BlackBoxConfig(agent="no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_function("no_such_module_here:run")
    with pytest.raises(ValueError, match="has no"):
        load_function("rlplat_demo.agents:missing")


@pytest.mark.parametrize("override, message", [
    ("agent.loops.blackbox.agent=nope.mod:run", "cannot import 'nope.mod'"),
    ("agent.gateway.host=0.0.0.0", "set agent.gateway.api_key"),
    ("agent.gateway.port=99999", "port must be in"),
    ("agent.gateway.on_prefix_break=merge", "on_prefix_break must be one of"),
    ("agent.loops.blackbox.agent=null", "give exactly one of agent"),
    ("agent.loop_names.tool=no_such_loop", "no_such_loop"),
])
def test_bad_gateway_and_blackbox_keys_are_refused_at_load(override, message, tmp_path):
    from rlplat.config import ConfigError, load_config
    from rlplat_demo import preset

    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*preset("tools-blackbox"), override, f"trainer.output_dir={tmp_path}"], algo="grpo")


def test_a_refused_request_leaves_its_session_as_it_was(gateway):
    manager, gateway = gateway
    session = gateway.open(manager.replicas.sticky(), SAMPLING)
    client = client_for(gateway.base_url(session.id))
    messages = [{"role": "user", "content": "12*12="}]
    message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    history = [*messages, message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    before = list(session.segments[0].builder.response_ids)
    with pytest.raises(openai.BadRequestError):  # refused after its new message was appended
        client.chat.completions.create(model="policy", messages=history, max_tokens=0)
    assert session.segments[0].builder.response_ids == before
    client.chat.completions.create(model="policy", messages=history)  # the same history continues cleanly
    closed = gateway.close(session.id)
    assert closed.prefix_breaks == 0 and len(closed.segments) == 1 and closed.segments[0].calls == 2


def test_the_tool_loop_records_the_version_of_each_sampled_token(engine, tokenizer):
    from rlplat_agents.tools import read_tools_file

    tools = {tool.name: tool for tool in (spec.build() for spec in read_tools_file(tool_demo.tools_config_file()))}
    manager = AgentLoopManager([EngineClient(engine)], tokenizer, AgentConfig(loop="tool", loops={"tool": {"max_turns": 2}}),
                               pad_token_id=tokenizer.pad_token_id, max_prompt_length=64, tools=tools)
    engine.set_weights_version(5)
    try:
        batch = manager.generate(tool_prompts(tokenizer, 4), SamplingParams(n=4, temperature=1.0, seed=2), 40)
    finally:
        engine.set_weights_version(0)
    mask, versions = batch.batch["response_mask"].bool(), batch.batch["policy_version"]
    assert bool((versions[mask] == 5).all()) and bool((versions[~mask] == -1).all())
