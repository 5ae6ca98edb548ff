"""The tool demo's shipped assets: a tokenizer and chat template that are append-only, a model that calls
the calculator sometimes and answers directly under greedy decoding, the task data, the scorer."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rlplat.data import load_datasets
from rlplat_demo import tools, tools_build
from rlplat.testing import RewardScorerConformance, ScorerCase

TOOLS = [tools.TOOL_SCHEMA]
CALL = f'<tool_call>\n{tools.CALL_PREFIX}37*48{tools.CALL_SUFFIX}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools.model_dir())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tools.model_dir()).eval()


@pytest.fixture(scope="module")
def build_info():
    return json.loads((tools.assets_dir() / "build_info.json").read_text())


def operands(path, operator):
    return [tuple(map(int, row[0]["content"].rstrip("=").split(operator))) for row in pq.read_table(path)["prompt"].to_pylist()]


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_assets_exist_and_stay_small():
    for path in (tools.model_dir() / "model.safetensors", tools.tools_config_file(), tools.assets_dir() / "build_info.json",
                 *(tools.data_file(name) for name in ("train", "val", "env_train", "env_val"))):
        assert path.is_file(), path
    total = sum(path.stat().st_size for path in tools.assets_dir().rglob("*") if path.is_file())
    assert total < 4_000_000, total


def test_the_model_is_the_demo_architecture_with_the_tool_vocabulary(model, tokenizer):
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (128, 2)
    assert sum(parameter.numel() for parameter in model.parameters()) < 600_000
    assert model.config.vocab_size == len(tools.VOCABULARY) == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_the_byte_level_spellings_are_those_of_gpt2_style_tokenizers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    assert all(tools.BYTE_LEVEL.get(character, character) == table[ord(character)] for character in tools.CHARACTERS)


def test_autotokenizer_loads_the_shipped_tokenizer_as_the_one_the_model_was_trained_with(tokenizer):
    # Next to a qwen2 config.json, AutoTokenizer rebuilds a Qwen2Tokenizer from the vocabulary; the demo's
    # tokenizer is built the same way, so both give the same ids and text.
    built = tools.tool_tokenizer()
    text = built.apply_chat_template(
        [{"role": "user", "content": "37*48="}, tools.call_message("37*48"), {"role": "tool", "content": "1776"},
         {"role": "assistant", "content": "1776"}, {"role": "user", "content": "wrong, try again; (x + y) / 2\n"}],
        tools=TOOLS, tokenize=False)
    assert encode(tokenizer, text) == encode(built, text)
    assert tokenizer.decode(encode(tokenizer, text)) == text
    assert tokenizer.chat_template == tools.CHAT_TEMPLATE


def test_markers_and_fixed_fragments_are_single_tokens(tokenizer):
    for token in [*tools.SPECIAL_TOKENS, *tools.WORD_TOKENS]:
        assert len(encode(tokenizer, token)) == 1, token
    assert len(encode(tokenizer, CALL)) == 11  # tag, newline, prefix, 5 characters, suffix, newline, tag


def test_tool_tags_survive_skipping_special_tokens_and_chatml_markers_do_not(tokenizer):
    ids = encode(tokenizer, f"<|im_start|>assistant\n{CALL}<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "\n" + CALL


def test_a_tool_conversation_renders_as_chatml_with_one_compact_system_line(tokenizer):
    messages = [{"role": "user", "content": "37*48="}, tools.call_message("37*48"), {"role": "tool", "content": "1776"},
                {"role": "assistant", "content": "1776"}]
    assert tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False) == (
        "<|im_start|>system\n<tools>calculator</tools><|im_end|>\n<|im_start|>user\n37*48=<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n<|im_start|>assistant\n1776<|im_end|>")
    assert len(tools.render_ids(tokenizer, messages, TOOLS)) == 56


def test_without_tools_there_is_no_system_line(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"


def test_the_template_is_append_only_for_a_tool_conversation(tokenizer):
    # What the tool loop builds: the prompt, the model's tokens verbatim, the template's delta for the tool
    # message (computed here against a prefix of our own), the model's answer.
    user = {"role": "user", "content": "37*48="}
    prompt = tools.render_ids(tokenizer, [user], TOOLS, add_generation_prompt=True)
    base = tools.render_ids(tokenizer, [{"role": "user", "content": "5*5="}, {"role": "assistant", "content": "25"}], TOOLS)
    extended = tools.render_ids(tokenizer, [{"role": "user", "content": "5*5="}, {"role": "assistant", "content": "25"},
                                            {"role": "tool", "content": "1776"}], TOOLS, add_generation_prompt=True)
    assert extended[: len(base)] == base
    delta = extended[len(base):]
    full = tools.render_ids(tokenizer, [user, tools.call_message("37*48"), {"role": "tool", "content": "1776"},
                                        {"role": "assistant", "content": "1776"}], TOOLS)
    assert prompt + encode(tokenizer, CALL + "<|im_end|>") + delta + encode(tokenizer, "1776<|im_end|>") == full
    assert delta == tools.message_delta(tokenizer, [{"role": "tool", "content": "1776"}], tools=TOOLS)


def test_the_template_is_append_only_for_a_retry_conversation(tokenizer):
    feedback = {"role": "user", "content": tools.FEEDBACK}
    prompt = tools.render_ids(tokenizer, [{"role": "user", "content": "12+34="}], add_generation_prompt=True)
    full = tools.render_ids(tokenizer, [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "45"},
                                        feedback, {"role": "assistant", "content": "46"}])
    attempt, answer = encode(tokenizer, "45<|im_end|>"), encode(tokenizer, "46<|im_end|>")
    assert prompt + attempt + tools.message_delta(tokenizer, [feedback]) + answer == full


def test_parallel_tool_results_share_one_user_turn(tokenizer):
    calls = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "4*5"}'}}]}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, calls, {"role": "tool", "content": "6"}, {"role": "tool", "content": "20"}],
        tools=TOOLS, tokenize=False)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4*5"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n20\n</tool_response><|im_end|>")


def test_the_scorer_reads_the_answer_after_the_last_tool_response_or_feedback():
    tool_conversation = f"{CALL}\n\n<tool_response>\n1776\n</tool_response>\n\n1776"
    assert tools.score("arith_tools", tool_conversation, "1776") == {"score": 1.0, "acc": True}
    assert tools.score("arith_tools", " 1776\n", "1776") == {"score": 1.0, "acc": True}
    assert tools.score("arith_tools", "1777", "1776")["score"] == 0.0
    assert tools.score("arith_tools", tool_conversation.replace("\n\n1776", "\n\n1777"), "1776")["score"] == 0.0
    assert tools.score("arith_tools", f"{CALL}", "1776")["score"] == 0.0  # the call never got its result
    assert tools.score("arith_tools", f"{tool_conversation}{CALL}", "1776")["score"] == 0.0
    assert tools.score("arith_chat", "45\n\nwrong, try again\n\n46", "46") == {"score": 1.0, "acc": True}
    assert tools.score("arith_chat", "46\n\nwrong, try again\n\n45", "46")["score"] == 0.0


class TestToolScorerConformance(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return tools.score

    @pytest.fixture
    def registered_name(self):
        return "tool_demo"

    @pytest.fixture
    def scorer_cases(self):
        return [ScorerCase("arith_tools", f"{CALL}\n\n<tool_response>\n1776\n</tool_response>\n\n1776", "1776", None, 1.0),
                ScorerCase("arith_tools", "1700", "1776", {"split": "val", "index": 0}, 0.0),
                ScorerCase("arith_chat", "45\n\nwrong, try again\n\n46", "46", None, 1.0)]


def test_parse_calls_and_the_reference_calculator():
    assert tools.parse_calls(CALL) == [("calculator", {"expression": "37*48"})]
    assert tools.parse_calls("<tool_call>\n{not json\n</tool_call>") == [("", None)]
    assert tools.calculator("calculator", {"expression": "37*48"}) == "1776"
    assert tools.calculator("calculator", {"expression": "37/48"}).startswith("error")
    assert tools.calculator("python", {"expression": "1+1"}).startswith("error")


def test_the_data_loads_through_rlplat_data_with_the_shipped_tokenizer(tokenizer):
    config = {"train_files": [str(tools.data_file("train"))], "val_files": [str(tools.data_file("val"))],
              "max_prompt_length": 16}
    train, val = load_datasets(config, tokenizer)
    assert len(val) == 200 and len(train) > 7000
    row = val[0]
    a, b = map(int, row["raw_prompt"][0]["content"].rstrip("=").split("*"))
    assert row["data_source"] == "arith_tools" and row["reward_model"]["ground_truth"] == str(a * b)
    assert row["extra_info"]["tools_kwargs"] == {"calculator": None}
    assert tokenizer.decode(row["input_ids"]) == f"<|im_start|>user\n{a}*{b}=<|im_end|>\n<|im_start|>assistant\n"
    env_train, env_val = load_datasets({"train_files": [str(tools.data_file("env_train"))],
                                        "val_files": [str(tools.data_file("env_val"))], "max_prompt_length": 16}, tokenizer)
    assert len(env_val) == 200 and env_val[0]["data_source"] == "arith_chat"


def test_rows_name_their_agent_loop():
    assert set(pq.read_table(tools.data_file("train"))["agent_name"].to_pylist()) == {"tool"}
    assert set(pq.read_table(tools.data_file("env_val"))["agent_name"].to_pylist()) == {"env"}


def test_validation_is_held_out_swapped_products_included():
    train, val = operands(tools.data_file("train"), "*"), operands(tools.data_file("val"), "*")
    assert not {pair for a, b in val for pair in ((a, b), (b, a))} & set(train)
    assert not set(operands(tools.data_file("env_train"), "+")) & set(operands(tools.data_file("env_val"), "+"))


def test_tools_yaml_is_the_calculator_schema():
    import yaml

    config = yaml.safe_load(tools.tools_config_file().read_text())
    assert config == tools.tools_config()
    schema = config["tools"][0]["tool_schema"]
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_the_shipped_model_starts_where_the_build_measured_it(model, tokenizer, build_info):
    # Teacher-forced figures are exact for greedy decoding: the shipped weights are the measured ones.
    pairs = tools.split_pairs(build_info["seed"])
    val = {kind: tools_build.encode_conversations(tokenizer, kind, pairs["multiply" if kind.startswith("multiply") else "add"][1])
           for kind in ("multiply_direct", "multiply_tool", "add_direct")}
    probe = tools_build.probe(model, tokenizer, val)
    for key in ("multiply/greedy_accuracy", "multiply/greedy_tool_rate", "add/greedy_accuracy"):
        assert probe[key] == pytest.approx(build_info["probe"][key], abs=1e-6), key  # counts out of 200
    for key in ("multiply/sampled_tool_rate", "multiply/sampled_call_exact", "multiply/sampled_copy_exact"):
        assert probe[key] == pytest.approx(build_info["probe"][key], abs=1e-3), key


def test_the_start_state_suits_the_demo(build_info):
    state = build_info["start_state"]
    assert state["multiply/greedy_accuracy"] < 0.15
    assert 0.2 <= state["multiply/sampled_tool_call_rate"] <= 0.4
    assert state["multiply/sampled_copy_accuracy"] >= 0.7 and state["multiply/sampled_call_correct"] >= 0.7
    assert 0.3 <= state["add/greedy_accuracy"] <= 0.65


def test_generation_through_the_tool_loop_agrees_with_the_teacher_forced_probe(model, tokenizer):
    pairs = tools.split_pairs(0)
    subset = {"multiply": (pairs["multiply"][0], pairs["multiply"][1][:40]), "add": (pairs["add"][0], pairs["add"][1][:40])}
    figures = tools.measure(model=model, tokenizer=tokenizer, pairs=subset, samples=1)
    val = {kind: tools_build.encode_conversations(tokenizer, kind, subset["multiply" if kind.startswith("multiply") else "add"][1])
           for kind in ("multiply_direct", "multiply_tool", "add_direct")}
    probe = tools_build.probe(model, tokenizer, val)
    assert figures["multiply/greedy_accuracy"] == pytest.approx(probe["multiply/greedy_accuracy"])
    assert figures["multiply/greedy_tool_call_rate"] == pytest.approx(probe["multiply/greedy_tool_rate"])
    assert figures["add/greedy_accuracy"] == pytest.approx(probe["add/greedy_accuracy"])
