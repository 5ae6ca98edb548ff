"""The chat template checked on live trajectories (``agent.template_check``): the agent-loop driver
re-renders a sample of its finished multi-turn trajectories and reports a drift as a ``template`` health
event, never an error. The model's side is scripted; the tokenizers carry the vendored templates."""

from __future__ import annotations

import math

import pytest

from rlplat.config_node import ConfigError, read_config_node
from rlplat.contracts.health import TemplateDriftError, health_events
from rlplat.contracts.rollout import RolloutDriverContext, SamplingParams, TokenOutput
from rlplat.data import collate
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, THINKING, chat_tokenizer, vendored_template
from rlplat_agents.chat import ChatRenderer
from rlplat_agents.config import AgentConfig
from rlplat_agents.driver import AgentLoopDriver
from rlplat_agents.manager import agent_metrics

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'
REASONED_ANSWER = "<think>\nThree fours are twelve.\n</think>\n\n12"
PROMPTS = 4


class ReplyingEngine:
    """A rollout engine with only ``generate_tokens``: it calls the calculator until the conversation
    holds a tool response, then answers; ``split_tags`` samples ``<tool_call>`` byte by byte, as a model
    may, instead of as the one token the tokenizer makes of it."""

    def __init__(self, tokenizer, first: str = CALL, then: str = "1776", split_tags: bool = False):
        self.tokenizer, self.first, self.then, self.split_tags = tokenizer, first, then, split_tags
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        if not self.split_tags:
            return self.tokenizer.encode(text, add_special_tokens=False)
        head, tag, tail = text.partition("<tool_call>")
        pieces = [self.tokenizer.encode(character, add_special_tokens=False) for character in tag]
        return self.tokenizer.encode(head, add_special_tokens=False) + sum(pieces, []) + (
            self.tokenizer.encode(tail, add_special_tokens=False) if tail else [])

    async def generate_tokens(self, prompt_ids, sampling):
        conversation = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        ids = self.encode(self.then if "<tool_response>" in conversation else self.first) + [self.end_of_turn]
        finish = "stop" if len(ids) <= sampling.max_new_tokens else "length"
        ids = ids[: sampling.max_new_tokens]
        return TokenOutput(ids, [-0.25] * len(ids), finish)


def compact_tool_calls() -> str:
    """chatml_tools, except that it re-serialises an earlier turn's tool calls without the newlines its
    own instructions (and so the model) put inside ``<tool_call>``."""
    template = vendored_template(CHATML_TOOLS)
    for old, new in (("'<tool_call>\\n{\"name\": '", "'<tool_call>{\"name\": '"), ('"}\\n</tool_call>"', '"}</tool_call>"')):
        assert old in template, f"the vendored template no longer writes {old}"
        template = template.replace(old, new)
    return template


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Tokenizer directories the driver loads, by name: the vendored ChatML-with-tools and thinking
    templates, and ChatML with compact tool calls."""
    directories = {}
    for name, template, text in ((CHATML_TOOLS, CHATML_TOOLS, None), (THINKING, THINKING, None),
                                 ("compact", CHATML_TOOLS, compact_tool_calls())):
        tokenizer = chat_tokenizer(template)
        if text is not None:
            tokenizer.chat_template = text
        directory = tmp_path_factory.mktemp(name)
        tokenizer.save_pretrained(directory)
        directories[name] = str(directory)
    return directories


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    path.write_text("tools:\n  - name: calculator\n")
    return str(path)


def driver_for(directory: str, node: dict, engine_of) -> tuple[AgentLoopDriver, object]:
    """The ``agent_loops`` driver as a rollout worker builds it, over ``engine_of(tokenizer)``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    engine = engine_of(tokenizer)
    context = RolloutDriverContext(engines=[engine], node={"max_prompt_length": 2048, **node}, tokenizer_path=directory,
                                   prompt_length=64, template_kwargs={})
    return AgentLoopDriver(context), tokenizer


def tool_driver(directory, tools_file, sample_rate=None, **engine):
    node = {"loop": "tool", "tools_config": tools_file}
    if sample_rate is not None:
        node["template_check"] = {"sample_rate": sample_rate}
    return driver_for(directory, node, lambda tokenizer: ReplyingEngine(tokenizer, **engine))


def reasoning_driver(directory, sample_rate=None):
    """The env loop with the retry environment: each answer opens with reasoning, and a wrong one gets a
    user message ("wrong, try again"), before which the thinking template drops earlier reasoning."""
    node = {"loop": "env", "environment": "retry"}
    if sample_rate is not None:
        node["template_check"] = {"sample_rate": sample_rate}
    return driver_for(directory, node, lambda tokenizer: ReplyingEngine(tokenizer, first=REASONED_ANSWER))


def prompt_batch(tokenizer, count: int = PROMPTS, first_index: int = 0):
    renderer = ChatRenderer(tokenizer)
    rows = []
    for index in range(first_index, first_index + count):
        messages = [{"role": "user", "content": f"What is {index} * 7?"}]
        rows.append({"input_ids": renderer.prompt_ids(messages), "raw_prompt": messages, "data_source": "t",
                     "reward_model": {"ground_truth": "1776"}, "extra_info": {}, "index": index})
    return collate(rows, tokenizer.pad_token_id)


def generate(driver, tokenizer, seed=11, **batch):
    return driver.generate(prompt_batch(tokenizer, **batch), SamplingParams(n=2, seed=seed, max_new_tokens=256))


# -- a template that only appends ------------------------------------------------------------------------

def test_a_template_that_only_appends_is_checked_and_reports_nothing(tokenizer_dirs, tools_file):
    driver, tokenizer = tool_driver(tokenizer_dirs[CHATML_TOOLS], tools_file, sample_rate=1.0)
    out = generate(driver, tokenizer)
    metrics = agent_metrics(out)
    assert metrics["agent/turns/mean"] == 2  # a call, then the answer: every trajectory is multi-turn
    assert metrics["agent/template_checked"] == 2 * PROMPTS and metrics["agent/template_drifted"] == 0
    assert health_events(out.meta_info) == []


def test_the_default_rate_checks_the_first_multi_turn_trajectory_at_least(tokenizer_dirs, tools_file):
    driver, tokenizer = tool_driver(tokenizer_dirs[CHATML_TOOLS], tools_file)
    assert driver.config.template_check.sample_rate == 0.05
    out = generate(driver, tokenizer)
    assert out.non_tensor_batch["agent_template_checked"][0] == 1.0
    assert agent_metrics(out)["agent/template_drifted"] == 0 and health_events(out.meta_info) == []


def test_single_turn_trajectories_are_not_checked(tokenizer_dirs, tools_file):
    driver, tokenizer = tool_driver(tokenizer_dirs[CHATML_TOOLS], tools_file, sample_rate=1.0, first="1776")
    out = generate(driver, tokenizer)
    assert agent_metrics(out)["agent/turns/mean"] == 1 and agent_metrics(out)["agent/template_checked"] == 0


def test_a_model_that_samples_a_tag_in_other_tokens_than_the_tokenizers_is_not_a_drift(tokenizer_dirs, tools_file):
    # The model spells <tool_call> byte by byte; the template's rendering has the same text, tokenized
    # as one token. The trained tokens differ from a re-tokenization, but not because of the template.
    driver, tokenizer = tool_driver(tokenizer_dirs[CHATML_TOOLS], tools_file, sample_rate=1.0, split_tags=True)
    out = generate(driver, tokenizer)
    assert agent_metrics(out)["agent/tool_calls/mean"] == 1, "the split tag was not read as a call"
    assert agent_metrics(out)["agent/template_checked"] == 2 * PROMPTS and agent_metrics(out)["agent/template_drifted"] == 0


class SloppyOnceEngine(ReplyingEngine):
    """Writes one prompt's tool call with an extra blank line inside ``<tool_call>`` (the hermes parser still
    reads it; the template writes the call without it), every other prompt's as the template does."""

    async def generate_tokens(self, prompt_ids, sampling):
        conversation = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.first = CALL.replace("<tool_call>\n", "<tool_call>\n\n") if "What is 0 *" in conversation else CALL
        return await super().generate_tokens(prompt_ids, sampling)


@pytest.mark.parametrize("share, reported", [(0.5, False), (0.25, True)])
def test_a_few_turns_the_model_formats_its_own_way_are_counted_not_reported(tokenizer_dirs, tools_file, share, reported):
    node = {"loop": "tool", "tools_config": tools_file,
            "template_check": {"sample_rate": 1.0, "noncanonical_share": share}}
    driver, tokenizer = driver_for(tokenizer_dirs[CHATML_TOOLS], node, lambda tokenizer: SloppyOnceEngine(tokenizer))
    out = generate(driver, tokenizer)
    metrics = agent_metrics(out)
    assert metrics["agent/tool_calls/mean"] == 1, "the sloppy call was not read as a call"
    assert metrics["agent/template_checked"] == 2 * PROMPTS and metrics["agent/template_noncanonical"] == 2  # of 8
    assert metrics["agent/template_drifted"] == (2 if reported else 0)
    assert len(health_events(out.meta_info)) == int(reported)


# -- templates that drift --------------------------------------------------------------------------------

def test_a_template_that_drops_earlier_reasoning_is_reported_in_the_first_batch(tokenizer_dirs):
    driver, tokenizer = reasoning_driver(tokenizer_dirs[THINKING])
    out = generate(driver, tokenizer)  # no error: the rollout's work is kept
    (event,) = health_events(out.meta_info)
    assert event.check == "template" and event.role == "rollout"
    assert isinstance(event.error(step=1), TemplateDriftError)
    figures = event.figures
    # Row 0 is the first multi-turn trajectory, always checked. Its first turn opens with <think>, right
    # after its prompt; the template drops that reasoning once the user's "wrong, try again" follows.
    prompt_length = len(ChatRenderer(tokenizer).prompt_ids([{"role": "user", "content": "What is 0 * 7?"}]))
    assert (figures["row"], figures["uid"], figures["first_divergence_token"]) == (0, "i0", prompt_length)
    assert (figures["message_index"], figures["role"]) == (1, "assistant")
    assert "'<think>'" in figures["expected"] and "'<think>'" not in figures["rendered"]
    assert f"at token {prompt_length} of its prompt and response, in message 1 (assistant)" in event.message
    metrics = agent_metrics(out)
    assert figures["checked"] == metrics["agent/template_checked"] >= 1
    assert figures["drifted"] == metrics["agent/template_drifted"] >= 1


def test_a_template_that_reserialises_tool_calls_is_reported_at_the_call(tokenizer_dirs, tools_file):
    driver, tokenizer = tool_driver(tokenizer_dirs["compact"], tools_file, sample_rate=1.0)
    out = generate(driver, tokenizer)
    (event,) = health_events(out.meta_info)
    assert event.figures["checked"] == event.figures["drifted"] == 2 * PROMPTS
    # The first turn is <tool_call> (one token) then "\n"; the template writes "{" where the model wrote "\n".
    prompt_length = int(out.batch["attention_mask"][0, :2048].sum())
    assert event.figures["first_divergence_token"] == prompt_length + 1
    # The excerpts show the six tokens before the first differing one, then it.
    assert event.figures["expected"].split(" | ")[5:7] == ["'<tool_call>'", "'\\n'"]
    assert event.figures["rendered"].split(" | ")[5:7] == ["'<tool_call>'", "'{'"]


def test_a_rate_of_zero_checks_nothing(tokenizer_dirs):
    driver, tokenizer = reasoning_driver(tokenizer_dirs[THINKING], sample_rate=0)
    out = generate(driver, tokenizer)
    assert agent_metrics(out)["agent/template_checked"] == agent_metrics(out)["agent/template_drifted"] == 0
    assert health_events(out.meta_info) == []


# -- which trajectories ------------------------------------------------------------------------------------

def test_after_the_first_check_only_the_sample_is_checked(tokenizer_dirs, tools_file):
    driver, tokenizer = tool_driver(tokenizer_dirs[CHATML_TOOLS], tools_file, sample_rate=1e-12)
    first = generate(driver, tokenizer)
    assert first.non_tensor_batch["agent_template_checked"].tolist() == [1.0] + [0.0] * (2 * PROMPTS - 1)
    second = generate(driver, tokenizer, first_index=PROMPTS)
    assert agent_metrics(second)["agent/template_checked"] == 0


def test_the_sample_is_the_same_for_the_same_seed_and_rows(tokenizer_dirs, tools_file):
    def checked(seed):
        driver, tokenizer = tool_driver(tokenizer_dirs[CHATML_TOOLS], tools_file, sample_rate=0.5)
        return generate(driver, tokenizer, seed=seed, count=16).non_tensor_batch["agent_template_checked"].tolist()

    assert checked(11) == checked(11)
    assert checked(11) != checked(12)
    assert 0 < sum(checked(11)) < 32


# -- the key -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [1.5, -1, math.nan])
def test_a_rate_outside_zero_to_one_is_refused_naming_the_key(rate):
    with pytest.raises(ConfigError, match=r"agent\.template_check: sample_rate must be a fraction in \[0, 1\]"):
        read_config_node({"loop": "tool", "template_check": {"sample_rate": rate}}, AgentConfig, "agent")


def test_a_bad_rate_stops_the_run_at_load():
    import rlplat_demo as demo
    from rlplat.config import load_config

    with pytest.raises(ConfigError, match=r"agent\.template_check: sample_rate must be a fraction in \[0, 1\].*got 1\.5"):
        load_config(None, [f"model.path={demo.model_dir()}", f"data.train_files=[{demo.train_file()}]",
                           "agent.loop=single_turn", "agent.template_check.sample_rate=1.5", "cluster.backend=local"])
