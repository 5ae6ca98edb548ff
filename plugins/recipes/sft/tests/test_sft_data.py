"""rlplat_sft.data: which tokens carry loss, the batch layout, and malformed rows named before training."""

from __future__ import annotations

import json

import pytest
import torch

from rlplat.data import DataError

from rlplat.kits.data import write_parquet
from rlplat_sft.data import ExampleEncoder, SFTDataConfig, SFTDataset, collate_examples
from rlplat.testing.chat_tokenizers import chat_tokenizer
from rlplat.testing.tiny_models import arithmetic_tokenizer

CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+3"}}}
CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calc", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


def hand_built(tokenizer, pieces):
    """Token ids and loss mask of ``(text, trained)`` pieces, each encoded on its own (the tiny tokenizers
    are byte-level without merges, so this equals encoding the whole text)."""
    ids, mask = [], []
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


CHATML_PIECES = [
    ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n", False),
    ('<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call><|im_end|>', True),
    ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
    ("It is 5.<|im_end|>", True),
    ("\n", False),
]

LLAMA3_PIECES = [
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>"
     "\n\nWhat is 2+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
    ('{"name": "calc", "parameters": {"expr": "2+3"}}<|eot_id|>', True),
    ("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
    ("It is 5.<|eot_id|>", True),
]


@pytest.mark.parametrize("template, pieces", [("chatml_tools", CHATML_PIECES), ("llama3_tools", LLAMA3_PIECES)])
def test_exactly_the_assistant_tokens_of_a_tool_calling_conversation_carry_loss(template, pieces):
    tokenizer = chat_tokenizer(template)
    example = ExampleEncoder(tokenizer).encode(CONVERSATION)
    assert (example.input_ids, example.loss_mask) == hand_built(tokenizer, pieces)


def test_last_turn_only_trains_the_last_assistant_turn():
    tokenizer = chat_tokenizer("chatml_tools")
    example = ExampleEncoder(tokenizer, last_turn_only=True).encode(CONVERSATION)
    pieces = [(text, trained and text.startswith("It is")) for text, trained in CHATML_PIECES]
    assert (example.input_ids, example.loss_mask) == hand_built(tokenizer, pieces)


def test_without_a_chat_template_the_prompt_keeps_its_special_tokens_and_each_answer_ends_with_eos():
    tokenizer = arithmetic_tokenizer()  # [BOS] prepended; ids: 0-9 are 4..13, + 14, = 15, EOS 2
    messages = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "15"},
                {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    example = ExampleEncoder(tokenizer).encode(messages)
    assert example.input_ids == [1, 5, 6, 14, 7, 15, 5, 9, 2, 5, 14, 5, 15, 6, 2]
    assert example.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


def test_a_batch_splits_each_example_at_its_first_trained_token():
    rows = [{"input_ids": [1, 5, 15, 7, 2], "loss_mask": [0, 0, 0, 1, 1], "index": 0},
            {"input_ids": [1, 15, 8, 9, 6, 2], "loss_mask": [0, 0, 1, 0, 1, 1], "index": 1}]
    batch = collate_examples(rows, pad_token_id=0).batch
    assert batch["input_ids"].tolist() == [[1, 5, 15, 7, 2, 0, 0], [0, 1, 15, 8, 9, 6, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 1, 2, 3, 4, 5]]
    assert batch["responses"].tolist() == [[7, 2, 0, 0], [8, 9, 6, 2]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 1, 1]]


def dataset(tmp_path, rows, tokenizer=None, **settings):
    path = write_parquet(rows, tmp_path / "sft.parquet")
    config = SFTDataConfig(train_files=[path], **settings)
    return SFTDataset(config.train_files, tokenizer or chat_tokenizer("chatml_tools"), config), path


def test_a_parquet_file_with_tool_calls_as_json_strings_reads_back_the_same_example(tmp_path):
    stored = [dict(message) for message in CONVERSATION]
    stored[2] = {**stored[2], "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": json.dumps({"expr": "2+3"})}}]}
    data, _ = dataset(tmp_path, [{"messages": stored}])
    expected = ExampleEncoder(chat_tokenizer("chatml_tools")).encode(CONVERSATION)
    assert (data[0]["input_ids"], data[0]["loss_mask"]) == (expected.input_ids, expected.loss_mask)


def test_prompt_and_response_columns_train_the_response_only(tmp_path):
    data, _ = dataset(tmp_path, [{"prompt": "12+3=", "response": "15"}], arithmetic_tokenizer())
    assert data[0]["input_ids"] == [1, 5, 6, 14, 7, 15, 5, 9, 2]
    assert data[0]["loss_mask"] == [0, 0, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("bad, says", [
    ({"role": "robot", "content": "hi"}, "message 0 has role 'robot'"),
    ({"role": "user", "content": None}, "message 0 (user) has no content"),
])
def test_a_malformed_message_is_reported_with_file_row_and_column(tmp_path, bad, says):
    answer = {"role": "assistant", "content": "b"}
    rows = [{"messages": [{"role": "user", "content": "a"}, answer]}, {"messages": [bad, answer]}]
    with pytest.raises(DataError) as error:
        dataset(tmp_path, rows)
    assert f"sft.parquet, row 1, column 'messages': {says}" in str(error.value)


def test_a_conversation_without_an_assistant_turn_is_refused_by_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"messages": [{"role": "user", "content": "a"}]}]
    with pytest.raises(DataError, match=r"row 1, column 'messages': the conversation has no assistant message"):
        dataset(tmp_path, rows)


def test_a_file_with_neither_schema_names_the_columns_it_needs(tmp_path):
    with pytest.raises(DataError, match=r"column 'response' is missing; columns present: prompt"):
        dataset(tmp_path, [{"prompt": "a"}])


def test_an_example_longer_than_max_length_is_an_error_or_dropped(tmp_path):
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "11+11=", "response": "22"}]
    with pytest.raises(DataError, match=r"row 1, column 'prompt': the example has 10 tokens, more than data.max_length=8"):
        dataset(tmp_path, rows, arithmetic_tokenizer(), max_length=8)
    data, _ = dataset(tmp_path, rows, arithmetic_tokenizer(), max_length=8, truncation="filter")
    assert len(data) == 1 and data.dropped_rows == 1


def test_the_loss_mask_agrees_with_the_engine_layout_on_padded_rows():
    tokenizer = chat_tokenizer("chatml_tools")
    example = ExampleEncoder(tokenizer).encode(CONVERSATION)
    batch = collate_examples([{"input_ids": example.input_ids, "loss_mask": example.loss_mask, "index": 0},
                              {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "index": 1}], pad_token_id=0).batch
    trained = batch["responses"][0][batch["response_mask"][0].bool()]
    expected = torch.tensor([token for token, keep in zip(example.input_ids, example.loss_mask) if keep])
    assert torch.equal(trained, expected)


def test_a_dataset_batch_is_the_batch_of_its_examples(tmp_path):
    data, _ = dataset(tmp_path, [{"prompt": "12+3=", "response": "15"}, {"prompt": "1+1=", "response": "2"},
                                 {"prompt": "99+99=", "response": "198"}], arithmetic_tokenizer())
    gathered = data.collate([2, 0]).batch
    built = collate_examples([data[2], data[0]], data.pad_token_id).batch
    assert all(torch.equal(gathered[key], built[key]) for key in built.keys())
