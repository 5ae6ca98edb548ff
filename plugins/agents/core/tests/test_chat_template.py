"""``rlplat_agents.chat``: prompts, deltas and ends of turns from a chat template, and the append-only check.

The tokenizers are the tiny byte-level ones of ``rlplat.testing.chat_tokenizers``: one token per byte,
the templates' control tokens whole. Expected texts below are written from the vendored templates.
"""

from __future__ import annotations

import pytest

from rlplat_agents.chat import (
    APPEND_ONLY,
    DIVERGES,
    UNSUPPORTED,
    ChatRenderer,
    Conversation,
    TemplateError,
    check_append_only,
    synthetic_conversations,
)
from rlplat.data import RLDataset
from rlplat.kits.data import write_parquet
from rlplat.testing.chat_tokenizers import (
    VENDORED_TEMPLATES,
    vendored_template,
    CHATML_TOOLS,
    LLAMA3_TOOLS,
    TEMPLATES,
    THINKING,
    chat_tokenizer,
    save_chat_tokenizer,
)
from rlplat.testing.tiny_models import arithmetic_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}
TOOLS = [WEATHER, CALCULATOR]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool(name, content):
    return {"role": "tool", "name": name, "content": content}


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer(CHATML_TOOLS)


@pytest.fixture(scope="module")
def llama3():
    return chat_tokenizer(LLAMA3_TOOLS)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- the tiny tokenizers ------------------------------------------------------------------------------

def test_every_vendored_template_has_a_tiny_tokenizer_carrying_it():
    assert TEMPLATES == VENDORED_TEMPLATES == (CHATML_TOOLS, THINKING, LLAMA3_TOOLS)
    for name in TEMPLATES:
        tokenizer = chat_tokenizer(name)
        assert tokenizer.chat_template == vendored_template(name)
        text = 'Héllo {"a": 1}\n\t<tool_call>'
        assert tokenizer.decode(encode(tokenizer, text)) == text


def test_control_tokens_are_single_ids_and_tags_stay_whole(chatml, llama3):
    assert [len(encode(chatml, token)) for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_response>")] \
        == [1, 1, 1, 1]
    assert encode(chatml, "<|im_end|>") == [chatml.eos_token_id]
    assert encode(llama3, "<|eot_id|>") == [llama3.eos_token_id]
    assert encode(chat_tokenizer(THINKING), "</think>") == [chat_tokenizer(THINKING).convert_tokens_to_ids("</think>")]


def test_a_saved_chat_tokenizer_loads_with_its_template(tmp_path):
    from transformers import AutoTokenizer

    save_chat_tokenizer(tmp_path, LLAMA3_TOOLS)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.chat_template == vendored_template(LLAMA3_TOOLS)
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatRenderer(loaded).prompt_ids(messages, TOOLS) == ChatRenderer(chat_tokenizer(LLAMA3_TOOLS)).prompt_ids(
        messages, TOOLS)


def test_an_unknown_template_name_is_refused():
    with pytest.raises(ValueError, match=r"no tiny tokenizer for template 'chatml'; choose one of"):
        chat_tokenizer("chatml")
    with pytest.raises(ValueError, match=r"no vendored chat template 'chatml'"):
        vendored_template("chatml")


# -- the vendored templates, as text ------------------------------------------------------------------

def test_chatml_groups_parallel_tool_results_in_one_user_turn(chatml):
    messages = [{"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris"),
                                                                    call("get_weather", city="Rome")]},
                tool("get_weather", "Sunny"), tool("get_weather", "Cloudy")]
    rendered = chatml.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nParis and Rome?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nCloudy\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_lists_the_tools_in_the_system_turn(chatml):
    rendered = chatml.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                          tools=[CALCULATOR], tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert ('<tools>\n{"type": "function", "function": {"name": "calculator", "description": "Arithmetic.", '
            '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
            '"required": ["expression"]}}}\n</tools>') in rendered
    assert rendered.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_llama3_writes_bos_headers_and_ipython_results(llama3):
    messages = [{"role": "user", "content": "12 * 7?"},
                {"role": "assistant", "content": "", "tool_calls": [call("calculator", expression="12 * 7")]},
                tool("calculator", "84")]
    assert llama3.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n12 * 7?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calculator", "parameters": {"expression": '
        '"12 * 7"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n84<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_the_thinking_template_drops_reasoning_before_the_last_user_message():
    tokenizer = chat_tokenizer(THINKING)
    first = {"role": "assistant", "content": "<think>\nSix.\n</think>\n\n6."}
    conversation = [{"role": "user", "content": "2 * 3?"}, first]
    assert tokenizer.apply_chat_template(conversation, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nSix.\n</think>\n\n6.<|im_end|>\n")
    followed = tokenizer.apply_chat_template([*conversation, {"role": "user", "content": "And 2 * 4?"}], tokenize=False)
    assert "<|im_start|>assistant\n6.<|im_end|>\n<|im_start|>user\nAnd 2 * 4?" in followed
    kept = tokenizer.apply_chat_template([*conversation, {"role": "user", "content": "And 2 * 4?"}], tokenize=False,
                                         keep_reasoning=True)
    assert "<|im_start|>assistant\n<think>\nSix.\n</think>\n\n6.<|im_end|>\n<|im_start|>user" in kept


# -- ChatRenderer -------------------------------------------------------------------------------------

def dataset_row(messages):
    return {"data_source": "chat", "prompt": messages, "reward_model": {"ground_truth": "4", "style": "rule"},
            "extra_info": {"split": "train"}}


@pytest.mark.parametrize("tokenizer", [chat_tokenizer(CHATML_TOOLS), chat_tokenizer(LLAMA3_TOOLS),
                                       arithmetic_tokenizer()], ids=["chatml", "llama3", "no template"])
def test_prompt_ids_equal_the_data_loaders_ids(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "1"}, {"role": "user", "content": "2+2="}]
    path = write_parquet([dataset_row(messages)], tmp_path / "prompts.parquet")
    assert ChatRenderer(tokenizer).prompt_ids(messages) == RLDataset(path, tokenizer)[0]["input_ids"]


def test_a_template_that_writes_bos_gets_it_once(llama3):
    ids = ChatRenderer(llama3).prompt_ids([{"role": "user", "content": "Hi"}])
    assert ids[:2] == [llama3.bos_token_id, llama3.convert_tokens_to_ids("<|start_header_id|>")]
    assert ids.count(llama3.bos_token_id) == 1


def test_prompt_ids_describe_the_tools_offered(chatml):
    renderer = ChatRenderer(chatml)
    messages = [{"role": "user", "content": "Hi"}]
    with_tools = chatml.decode(renderer.prompt_ids(messages, TOOLS))
    assert '"name": "get_weather"' in with_tools and '"name": "calculator"' in with_tools
    assert "# Tools" not in chatml.decode(renderer.prompt_ids(messages))


def test_the_end_of_turn_is_what_the_template_writes_after_an_assistants_content(chatml, llama3):
    chatml_renderer, llama3_renderer = ChatRenderer(chatml), ChatRenderer(llama3)
    assert chatml_renderer.end_of_turn_ids == (chatml.convert_tokens_to_ids("<|im_end|>"),)
    assert chatml_renderer.end_of_turn_text == "<|im_end|>"
    assert chatml_renderer.stop_token_ids == (chatml.convert_tokens_to_ids("<|im_end|>"),)  # EOS is <|im_end|>
    assert llama3_renderer.end_of_turn_ids == (llama3.convert_tokens_to_ids("<|eot_id|>"),)
    assert llama3_renderer.end_of_turn_text == "<|eot_id|>"


def test_a_turn_cut_short_is_closed_with_the_end_of_turn_tokens(chatml):
    renderer = ChatRenderer(chatml)
    finished, cut = encode(chatml, "4.<|im_end|>"), encode(chatml, "4 and")
    assert renderer.ends_turn(finished) and not renderer.ends_turn(cut)
    assert renderer.closing_ids(finished) == ()
    assert renderer.closing_ids(cut) == renderer.end_of_turn_ids


def test_a_chatml_delta_starts_with_the_newline_after_the_end_of_turn_token(chatml):
    renderer = ChatRenderer(chatml)
    assert renderer.delta_ids([tool("calculator", "84")], TOOLS) == encode(
        chatml, "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert renderer.delta_ids([tool("get_weather", "Sunny"), tool("get_weather", "Cloudy")], TOOLS) == encode(
        chatml, "\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nCloudy\n"
                "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert renderer.delta_ids([{"role": "user", "content": "Wrong, try again."}]) == encode(
        chatml, "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")


def test_a_llama3_delta_is_the_next_blocks_through_the_generation_prompt(llama3):
    renderer = ChatRenderer(llama3)
    assert renderer.delta_ids([tool("calculator", "84")], TOOLS) == encode(
        llama3, "<|start_header_id|>ipython<|end_header_id|>\n\n84<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert renderer.delta_ids([{"role": "user", "content": "Wrong, try again."}]) == encode(
        llama3, "<|start_header_id|>user<|end_header_id|>\n\nWrong, try again.<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")


def run_agent_loop(tokenizer, renderer, prompt, turns, tools):
    """Token in, token out as an agent loop builds it: the prompt's ids, then per model turn the tokens
    the model wrote (its text, encoded) and the delta of the messages that follow it."""
    ids = renderer.prompt_ids(prompt, tools)
    for model_text, following in turns:
        sampled = encode(tokenizer, model_text)
        assert renderer.ends_turn(sampled)
        ids += sampled
        if following:
            ids += renderer.delta_ids(following, tools)
    return ids


# One conversation with parallel calls, a second tool turn and a follow-up user message: the model's
# own text per turn (as it would sample it), and the messages in Hugging Face form.
CONVERSATION_PROMPT = [{"role": "system", "content": "Use the tools."},
                       {"role": "user", "content": "Weather in Paris and Rome, then 12 * 7?"}]
RESULTS_1 = [tool("get_weather", "Sunny, 21 C."), tool("get_weather", "Cloudy, 18 C.")]
RESULTS_2 = [tool("calculator", "84")]
FOLLOW_UP = [{"role": "user", "content": "Thanks. Warmer where?"}]
ASSISTANT_MESSAGES = [
    {"role": "assistant", "content": "",
     "tool_calls": [call("get_weather", city="Paris"), call("get_weather", city="Rome")]},
    {"role": "assistant", "content": "Now the product.", "tool_calls": [call("calculator", expression="12 * 7")]},
    {"role": "assistant", "content": "It is 84."},
    {"role": "assistant", "content": "In Paris."},
]
WHOLE_CONVERSATION = [*CONVERSATION_PROMPT, ASSISTANT_MESSAGES[0], *RESULTS_1, ASSISTANT_MESSAGES[1], *RESULTS_2,
                      ASSISTANT_MESSAGES[2], *FOLLOW_UP, ASSISTANT_MESSAGES[3]]


def test_chatml_prompt_plus_verbatim_turns_plus_deltas_is_the_templates_rendering(chatml):
    renderer = ChatRenderer(chatml)
    ids = run_agent_loop(chatml, renderer, CONVERSATION_PROMPT, [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>', RESULTS_1),
        ('Now the product.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
         '</tool_call><|im_end|>', RESULTS_2),
        ("It is 84.<|im_end|>", FOLLOW_UP),
        ("In Paris.<|im_end|>", []),
    ], TOOLS)
    whole = encode(chatml, chatml.apply_chat_template(WHOLE_CONVERSATION, tools=TOOLS, tokenize=False))
    assert ids + encode(chatml, "\n") == whole  # the template's newline after the last <|im_end|> is not sampled


def test_llama3_prompt_plus_verbatim_turns_plus_deltas_is_the_templates_rendering(llama3):
    renderer = ChatRenderer(llama3)
    ids = run_agent_loop(llama3, renderer, CONVERSATION_PROMPT, [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
         '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>', RESULTS_1),
        ('Now the product.\n{"name": "calculator", "parameters": {"expression": "12 * 7"}}<|eot_id|>', RESULTS_2),
        ("It is 84.<|eot_id|>", FOLLOW_UP),
        ("In Paris.<|eot_id|>", []),
    ], TOOLS)
    assert ids == encode(llama3, llama3.apply_chat_template(WHOLE_CONVERSATION, tools=TOOLS, tokenize=False))


def test_template_kwargs_reach_the_template():
    tokenizer = chat_tokenizer(THINKING)
    conversation = [{"role": "user", "content": "2 * 3?"},
                    {"role": "assistant", "content": "<think>\nSix.\n</think>\n\n6."},
                    {"role": "user", "content": "And 2 * 4?"}]
    assert "<think>\nSix." not in tokenizer.decode(ChatRenderer(tokenizer).prompt_ids(conversation))
    assert "<think>\nSix." in tokenizer.decode(ChatRenderer(tokenizer, {"keep_reasoning": True}).prompt_ids(conversation))
    with pytest.raises(ValueError, match=r"template_kwargs may not set \['add_generation_prompt', 'tools'\]"):
        ChatRenderer(tokenizer, {"tools": [], "add_generation_prompt": False})


REWRITES_EARLIER_REPLIES = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and not loop.last %}{{- '(an earlier reply)' }}{%- else %}{{- m.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_delta_that_would_change_the_turn_before_it_is_a_template_error_naming_the_messages():
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    tokenizer.chat_template = REWRITES_EARLIER_REPLIES
    with pytest.raises(TemplateError, match=(
        r"cannot compute the tokens the chat template adds for messages \[0\] tool 'calculator': '84': the "
        r"template renders the assistant turn before them differently once they follow \(it renders "
        r"'.*Hello! How can I help\?<\|im_end\|>\\n' as '.*\(an earlier reply\)<\|im_end\|>.*'.*\); it is not "
        r"append-only there"
    )):
        ChatRenderer(tokenizer).delta_ids([tool("calculator", "84")])


def test_malformed_messages_are_refused_with_where(chatml):
    renderer = ChatRenderer(chatml)
    with pytest.raises(ValueError, match=r"delta_ids: message 1 is the assistant's; a delta holds only"):
        renderer.delta_ids([tool("calculator", "84"), {"role": "assistant", "content": "84"}])
    with pytest.raises(ValueError, match=r"prompt_ids: expected a non-empty list of .* messages, got an empty list"):
        renderer.prompt_ids([])
    with pytest.raises(ValueError, match=r"prompt_ids: message 1 is \{'content': 'x'\}, not a dict with a string 'role'"):
        renderer.prompt_ids([{"role": "user", "content": "Hi"}, {"content": "x"}])


def test_without_a_chat_template_there_is_no_delta():
    renderer = ChatRenderer(arithmetic_tokenizer())
    with pytest.raises(TemplateError, match=r"cannot tokenize messages \[0\] user: '1' as a turn: the tokenizer has "
                                            r"no chat template"):
        renderer.delta_ids([{"role": "user", "content": "1"}])
    with pytest.raises(TemplateError, match="the tokenizer has no chat template: there is nothing to check"):
        check_append_only(arithmetic_tokenizer())


# -- check_append_only --------------------------------------------------------------------------------

@pytest.mark.parametrize("template", [CHATML_TOOLS, LLAMA3_TOOLS])
def test_the_chatml_and_llama3_templates_are_append_only(template):
    report = check_append_only(chat_tokenizer(template))
    assert report.append_only
    assert [check.name for check in report.conversations] == [c.name for c in synthetic_conversations()]
    assert {check.status for check in report.conversations} == {APPEND_ONLY}
    assert "parallel tool calls" in [check.name for check in report.conversations]


def test_the_thinking_template_is_not_append_only_at_the_reasoning_of_an_earlier_turn():
    report = check_append_only(chat_tokenizer(THINKING))
    assert not report.append_only
    assert [check.name for check in report.diverging] == ["reasoning + follow-up", "reasoning + tools + follow-up"]
    divergence = report.diverging[0].divergence
    assert (divergence.message_index, divergence.role, divergence.check, divergence.level) == (
        1, "assistant", "turn by turn", "text")
    assert divergence.expected.endswith(
        "<|im_start|>assistant\n<think>\nThree fours are twelve.\n</think>\n\n12.<|im_end|>")
    assert "<|im_start|>assistant\n12.<|im_end|>\n<|im_start|>user\nAnd 3 * 5?" in divergence.rendered
    # Reasoning in the last turns only (tool results follow, no user message) renders as sampled.
    assert {check.name: check.status for check in report.conversations}["reasoning + tool calls"] == APPEND_ONLY


def test_keeping_the_reasoning_makes_the_thinking_template_append_only():
    report = check_append_only(chat_tokenizer(THINKING), template_kwargs={"keep_reasoning": True})
    assert report.append_only
    assert len(report.conversations) == len(synthetic_conversations(reasoning=True))


def test_text_that_is_kept_but_tokenized_differently_is_a_divergence_of_tokens():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # One merge, ":" + " ": the generation prompt ends with ":", and the reply the template writes
    # after it starts with " ", so the sampled reply's first token is not the one the template gives.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocabulary = {symbol: index for index, symbol in enumerate(alphabet)}
    vocabulary[":Ġ"] = len(vocabulary)
    core = Tokenizer(models.BPE(vocab=vocabulary, merges=[(":", "Ġ")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")
    tokenizer.chat_template = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '<|end|>\\n' }}{%- endfor %}"
                               "{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}")
    conversation = Conversation("single turn", ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}))
    report = check_append_only(tokenizer, [conversation])
    assert not report.append_only
    divergence = report.diverging[0].divergence
    assert (divergence.message_index, divergence.role, divergence.check, divergence.level) == (
        1, "assistant", "turn by turn", "tokens")
    # Tokens are shown one by one, decoded: the prompt's last token ":" became ": " in the whole.
    assert divergence.expected.endswith("'n' | 't' | ':'")
    assert divergence.rendered.endswith("'n' | 't' | ': ' | 'Y' | 'o' | '<|end|>'")


NUMBERS_NON_ASSISTANT_MESSAGES = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + ' #' + (loop.index | string) + '\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def test_a_delta_that_depends_on_earlier_turns_is_caught_on_the_agent_loops_path():
    # Rendering only appends, but each message is numbered: a delta computed after the fixed two-message
    # conversation numbers the next user message 3, wherever it really falls.
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    tokenizer.chat_template = NUMBERS_NON_ASSISTANT_MESSAGES
    follow_ups = [c for c in synthetic_conversations() if c.name == "follow-ups"]
    report = check_append_only(tokenizer, follow_ups)
    divergence = report.diverging[0].divergence
    assert (divergence.message_index, divergence.role, divergence.check, divergence.level) == (
        4, "user", "agent loop", "tokens")  # message 2 is numbered 3, as after the fixed conversation
    # expected: what the loop fed the model (its delta, numbered 3); rendered: the template's numbering.
    assert "'#' | '3'" in divergence.expected and "'#' | '5'" in divergence.rendered


def test_a_conversation_the_template_refuses_is_unsupported_and_not_checked():
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'tool' %}{{- raise_exception('tool messages are not supported') }}"
        "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    report = check_append_only(tokenizer)
    statuses = {check.name: check.status for check in report.conversations}
    assert statuses["follow-ups"] == APPEND_ONLY and statuses["tool call"] == UNSUPPORTED
    unsupported = next(check for check in report.conversations if check.name == "tool call")
    assert "tool messages are not supported" in unsupported.error
    assert report.append_only and DIVERGES not in statuses.values()


def test_a_template_without_a_special_end_of_turn_token_is_reported():
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    tokenizer.chat_template = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n\\n' }}{%- endfor %}"
                               "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    report = check_append_only(tokenizer)
    assert not report.append_only and report.conversations == ()
    assert report.problem == ("the chat template closes an assistant turn with '\\n\\n', which holds no special token: "
                              "a rollout has no token to stop the turn on, so multi-turn rollouts cannot use this "
                              "template")
    with pytest.raises(TemplateError, match="holds no special token"):
        ChatRenderer(tokenizer).end_of_turn_ids


def test_a_conversation_must_have_a_prompt_and_model_turns():
    user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    with pytest.raises(ValueError, match=r"conversation 'x': message 0 is the assistant's"):
        Conversation("x", (reply, user))
    with pytest.raises(ValueError, match=r"conversation 'x': no assistant message"):
        Conversation("x", (user,))
    with pytest.raises(ValueError, match=r"conversation 'x': messages 1 and 2 are both the assistant's"):
        Conversation("x", (user, reply, reply))


def test_the_report_serializes_to_plain_data():
    report = check_append_only(chat_tokenizer(THINKING))
    data = report.to_dict()
    assert data["append_only"] is False and data["end_of_turn"] == "<|im_end|>" and data["problem"] is None
    first = next(entry for entry in data["conversations"] if entry["status"] == DIVERGES)
    assert first["name"] == "reasoning + follow-up"
    assert (first["divergence"]["message_index"], first["divergence"]["role"]) == (1, "assistant")
