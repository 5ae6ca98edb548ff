"""``rlplat.data``: parquet prompts -> tokenized rows -> left-padded batches, resumable exactly.

Token ids come from the arithmetic tokenizer: ``[PAD]`` 0, ``[BOS]`` 1, digits ``d`` -> ``d + 4``,
``+`` 14, ``=`` 15; without a chat template it prepends BOS.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from rlplat.config_node import ConfigError
import torch

from rlplat.data import DataConfig, DataError, RLDataset, StatefulLoader, ValidationLoader, build_loaders, collate, load_datasets, read_data_config

from rlplat.kits.data import write_parquet
from rlplat.testing.tiny_models import arithmetic_tokenizer


def row(content="1+2=", ground_truth="3", data_source="arith", **extra):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"split": "train"},
        **extra,
    }


@pytest.fixture(scope="module")
def tokenizer():
    return arithmetic_tokenizer()


@pytest.fixture
def write(tmp_path):
    """``write(name, rows)``: a parquet file in tmp_path; returns its path."""
    return lambda name, rows: write_parquet(rows, tmp_path / name)


@pytest.fixture
def digits(write, tokenizer):
    """Five prompts ``"0="`` .. ``"4="``: row ``i`` encodes to ``[1, i + 4, 15]``."""
    return RLDataset(write("digits.parquet", [row(f"{i}=", str(i)) for i in range(5)]), tokenizer)


def indices(batches):
    return [batch.non_tensor_batch["index"].tolist() for batch in batches]


# -- schema and row errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_a_missing_column_is_named_with_the_file_and_the_columns_present(write, tokenizer, column):
    rows = [{key: value for key, value in row().items() if key != column}]
    path = write("no_column.parquet", rows)
    with pytest.raises(DataError) as error:
        RLDataset(path, tokenizer)
    message = str(error.value)
    assert path in message and f"column {column!r} is missing" in message
    present = ", ".join(name for name in ("data_source", "prompt", "reward_model", "extra_info") if name != column)
    assert f"columns present: {present}" in message


def test_a_custom_prompt_key_names_that_column_when_missing(write, tokenizer):
    path = write("plain.parquet", [row()])
    with pytest.raises(DataError, match=r"column 'question' is missing \(data.prompt_key names the prompt column\)"):
        RLDataset(path, tokenizer, prompt_key="question")


def test_a_message_without_content_names_the_file_row_and_column(write, tokenizer):
    rows = [row(), row(), {**row(), "prompt": [{"role": "user"}]}]
    path = write("bad_message.parquet", rows)
    with pytest.raises(DataError, match=rf"{path}, row 2, column 'prompt': message 0 is .* not a \{{'role': str, 'content': str\}} dict"):
        RLDataset(path, tokenizer)


def test_an_empty_message_list_names_the_row(write, tokenizer):
    path = write("empty.parquet", [row(), {**row(), "prompt": []}])
    with pytest.raises(DataError, match=rf"{path}, row 1, column 'prompt': expected a non-empty list .* got an empty list"):
        RLDataset(path, tokenizer)


def test_a_string_prompt_is_an_error_while_chat_templating_is_on(write, tokenizer):
    path = write("strings.parquet", [{**row(), "prompt": "1+2="}])
    with pytest.raises(DataError, match=rf"{path}, row 0, column 'prompt': .* got the string '1\+2=';.*data.apply_chat_template=false"):
        RLDataset(path, tokenizer)


def test_a_reward_model_without_ground_truth_names_the_row_and_column(write, tokenizer):
    rows = [row(), {**row(), "reward_model": {"style": "rule"}}]
    path = write("no_truth.parquet", rows)
    with pytest.raises(DataError, match=rf"{path}, row 1, column 'reward_model': 'ground_truth' is missing or null"):
        RLDataset(path, tokenizer)


def test_a_null_data_source_names_the_row_and_column(write, tokenizer):
    path = write("no_source.parquet", [row(), row(), {**row(), "data_source": None}])
    with pytest.raises(DataError, match=rf"{path}, row 2, column 'data_source': expected a string, got None"):
        RLDataset(path, tokenizer)


def test_the_row_index_is_counted_within_its_own_file(write, tokenizer):
    good = write("good.parquet", [row(), row(), row()])
    bad = write("bad.parquet", [row(), {**row(), "reward_model": {"style": "rule"}}])
    with pytest.raises(DataError, match=rf"{bad}, row 1, column 'reward_model'"):
        RLDataset([good, bad], tokenizer)


def test_a_file_that_is_not_parquet_is_named(tmp_path, tokenizer):
    path = tmp_path / "notes.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match=rf"data.train_files: {path} is not a readable parquet file"):
        RLDataset(str(path), tokenizer)


def test_missing_files_are_named_with_their_config_key(write, tmp_path, tokenizer):
    train = write("train.parquet", [row()])
    with pytest.raises(DataError, match=rf"^data.train_files: {tmp_path}/x.parquet does not exist$"):
        load_datasets({"train_files": [str(tmp_path / "x.parquet")]}, tokenizer)
    with pytest.raises(DataError, match=rf"^data.val_files: {tmp_path}/y.parquet does not exist$"):
        load_datasets({"train_files": train, "val_files": [str(tmp_path / "y.parquet")]}, tokenizer)


# -- tokenization ----------------------------------------------------------------------------------------


def test_without_a_chat_template_the_contents_are_concatenated_after_bos(write, tokenizer):
    messages = [{"role": "system", "content": "1"}, {"role": "user", "content": "2+3="}]
    dataset = RLDataset(write("two.parquet", [{**row(), "prompt": messages}]), tokenizer)
    assert dataset[0]["input_ids"] == [1, 5, 6, 14, 7, 15]  # [BOS] 1 2 + 3 =


def test_a_chat_template_is_rendered_with_a_generation_prompt_and_bos_is_not_doubled(write):
    templated = arithmetic_tokenizer()
    templated.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}{% if twice %}={% endif %}"
    )
    path = write("templated.parquet", [row("1+2")])
    assert RLDataset(path, templated)[0]["input_ids"] == [1, 5, 14, 6, 15]  # [BOS] 1 + 2 =
    with_kwargs = RLDataset(path, templated, apply_chat_template_kwargs={"twice": True})
    assert with_kwargs[0]["input_ids"] == [1, 5, 14, 6, 15, 15]


def test_with_chat_templating_off_a_string_prompt_is_tokenized_as_is(write, tokenizer):
    path = write("strings.parquet", [{**row(), "prompt": "12="}])
    assert RLDataset(path, tokenizer, apply_chat_template=False)[0]["input_ids"] == [1, 5, 6, 15]


def test_a_row_carries_its_fields_and_index(write, tokenizer):
    path = write("fields.parquet", [row("1=", "1"), row("2=", "2", data_source="other")])
    assert RLDataset(path, tokenizer)[1] == {
        "input_ids": [1, 6, 15],
        "raw_prompt": [{"role": "user", "content": "2="}],
        "data_source": "other",
        "reward_model": {"ground_truth": "2", "style": "rule"},
        "extra_info": {"split": "train"},
        "index": 1,
    }


def test_message_keys_other_rows_wrote_are_not_added_to_a_message(write, tokenizer):
    named = {**row(), "prompt": [{"role": "user", "content": "1=", "name": "alice"}]}
    dataset = RLDataset(write("names.parquet", [named, row("2=")]), tokenizer)
    assert dataset[0]["raw_prompt"] == [{"role": "user", "content": "1=", "name": "alice"}]
    assert dataset[1]["raw_prompt"] == [{"role": "user", "content": "2="}]


def test_a_missing_extra_info_column_gives_empty_dicts(write, tokenizer):
    rows = [{key: value for key, value in row().items() if key != "extra_info"}]
    assert RLDataset(write("no_extra.parquet", rows), tokenizer)[0]["extra_info"] == {}


def test_changing_a_returned_row_does_not_change_the_dataset(digits):
    digits[0]["reward_model"]["ground_truth"] = "changed"
    digits[0]["raw_prompt"][0]["content"] = "changed"
    assert digits[0]["reward_model"]["ground_truth"] == "0"
    assert digits[0]["raw_prompt"][0]["content"] == "0="


# -- max_prompt_length -----------------------------------------------------------------------------------

LONG = "12+34="  # [1, 5, 6, 14, 7, 8, 15]: 7 tokens


def test_truncation_error_names_the_file_row_and_length(write, tokenizer):
    path = write("long.parquet", [row(), row(LONG)])
    with pytest.raises(DataError, match=rf"{path}, row 1, column 'prompt': the prompt has 7 tokens, more than data.max_prompt_length=5"):
        RLDataset(path, tokenizer, max_prompt_length=5)


def test_truncation_left_keeps_the_last_tokens(write, tokenizer):
    dataset = RLDataset(write("long.parquet", [row(LONG)]), tokenizer, max_prompt_length=5, truncation="left")
    assert dataset[0]["input_ids"] == [6, 14, 7, 8, 15]


def test_truncation_right_keeps_the_first_tokens(write, tokenizer):
    dataset = RLDataset(write("long.parquet", [row(LONG)]), tokenizer, max_prompt_length=5, truncation="right")
    assert dataset[0]["input_ids"] == [1, 5, 6, 14, 7]


def test_truncation_filter_drops_long_rows_counts_and_logs_them(write, tokenizer, caplog):
    path = write("mixed.parquet", [row("1="), row(LONG), row("2="), row(LONG)])
    with caplog.at_level(logging.WARNING, logger="rlplat.data"):
        dataset = RLDataset(path, tokenizer, max_prompt_length=5, truncation="filter")
    assert (len(dataset), dataset.dropped_rows) == (2, 2)
    assert [dataset[i]["input_ids"] for i in range(2)] == [[1, 5, 15], [1, 6, 15]]
    assert [dataset.origin(i) for i in range(2)] == [(path, 0), (path, 2)]
    assert f"dropped 2 of 4 rows longer than data.max_prompt_length=5 (data.truncation=filter); the first: {path}, row 1, 7 tokens" in caplog.text


def test_a_prompt_exactly_at_the_limit_is_kept_whole(write, tokenizer):
    dataset = RLDataset(write("long.parquet", [row(LONG)]), tokenizer, max_prompt_length=7)
    assert dataset[0]["input_ids"] == [1, 5, 6, 14, 7, 8, 15]


# -- collate ---------------------------------------------------------------------------------------------


def test_collate_left_pads_to_the_longest_prompt_with_positions_counting_real_tokens():
    rows = [
        {"input_ids": [1, 5, 15], "raw_prompt": "a", "data_source": "s", "reward_model": {"ground_truth": "1"}, "extra_info": {}, "index": 7},
        {"input_ids": [1, 5, 14, 6, 15], "raw_prompt": "b", "data_source": "s", "reward_model": {"ground_truth": "3"}, "extra_info": {}, "index": 2},
    ]
    batch = collate(rows, pad_token_id=0)
    assert batch.batch["input_ids"].tolist() == [[0, 0, 1, 5, 15], [1, 5, 14, 6, 15]]
    assert batch.batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.batch["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert {batch.batch[key].dtype for key in ("input_ids", "attention_mask", "position_ids")} == {torch.int64}
    assert batch.non_tensor_batch["index"].tolist() == [7, 2]
    assert batch.non_tensor_batch["reward_model"].tolist() == [{"ground_truth": "1"}, {"ground_truth": "3"}]
    assert batch.non_tensor_batch["uid"].tolist() == ["i7", "i2"]


def test_collate_uids_are_the_prefix_and_the_dataset_index(digits):
    batch = collate([digits[3], digits[0]], digits.pad_token_id, uid_prefix="e2-")
    assert batch.non_tensor_batch["uid"].tolist() == ["e2-i3", "e2-i0"]


def test_collate_refuses_one_row_twice_since_the_uids_would_collide(digits):
    with pytest.raises(ValueError, match=r"dataset index\(es\) \[1\] appear more than once"):
        collate([digits[1], digits[0], digits[1]], 0)


# -- the training loader ---------------------------------------------------------------------------------


def test_each_epoch_visits_every_row_once_in_its_seeded_order(digits):
    loader = StatefulLoader(digits, 2, seed=3, drop_last=False)
    assert len(loader) == 3
    for epoch in range(3):
        batches = indices(loader)
        assert [len(batch) for batch in batches] == [2, 2, 1]
        assert sum(batches, []) == np.random.default_rng((3, epoch)).permutation(5).tolist()
    assert (loader.epoch, loader.position) == (3, 0)


def test_the_shuffle_changes_between_epochs_and_repeats_under_the_same_seed(digits):
    first, second = StatefulLoader(digits, 5, seed=0), StatefulLoader(digits, 5, seed=0)
    orders = indices(first.next_batch() for _ in range(3))
    assert indices(second.next_batch() for _ in range(3)) == orders
    assert len({tuple(order) for order in orders}) == 3
    assert orders == [np.random.default_rng((0, epoch)).permutation(5).tolist() for epoch in range(3)]


def test_without_shuffle_every_epoch_is_in_dataset_order(digits):
    loader = StatefulLoader(digits, 2, shuffle=False, drop_last=False)
    assert indices(loader.next_batch() for _ in range(4)) == [[0, 1], [2, 3], [4], [0, 1]]


def test_drop_last_skips_the_short_tail_of_each_epoch(digits):
    loader = StatefulLoader(digits, 2, seed=0)
    assert len(loader) == 2
    assert sum(indices(loader), []) == np.random.default_rng((0, 0)).permutation(5)[:4].tolist()
    assert (loader.epoch, loader.position) == (1, 0)


def test_training_uids_name_the_epoch_and_the_row(digits):
    loader = StatefulLoader(digits, 5, shuffle=False)
    assert loader.next_batch().non_tensor_batch["uid"].tolist() == ["e0-i0", "e0-i1", "e0-i2", "e0-i3", "e0-i4"]
    assert loader.next_batch().non_tensor_batch["uid"].tolist()[:2] == ["e1-i0", "e1-i1"]


def test_a_batch_larger_than_the_dataset_with_drop_last_is_refused(digits):
    with pytest.raises(DataError, match="data.train_batch_size=6 is larger than the 5 prompts of the training set"):
        StatefulLoader(digits, 6)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("taken", [1, 2, 3, 4, 5])
def test_a_restored_loader_continues_exactly_where_the_saved_one_stopped(digits, drop_last, taken):
    # batch size 2 over 5 prompts: 2 batches per epoch with drop_last, 3 without; 8 batches span 3-4
    # epochs, so the cut falls mid-epoch, on an epoch boundary and after one, depending on `taken`.
    reference = StatefulLoader(digits, 2, seed=5, drop_last=drop_last)
    expected = [reference.next_batch() for _ in range(8)]

    interrupted = StatefulLoader(digits, 2, seed=5, drop_last=drop_last)
    for _ in range(taken):
        interrupted.next_batch()
    state = json.loads(json.dumps(interrupted.state_dict()))

    resumed = StatefulLoader(digits, 2, seed=5, drop_last=drop_last)
    resumed.load_state_dict(state)
    rest = [resumed.next_batch() for _ in range(8 - taken)]
    assert [batch.batch["input_ids"].tolist() for batch in rest] == [batch.batch["input_ids"].tolist() for batch in expected[taken:]]
    assert [batch.non_tensor_batch["uid"].tolist() for batch in rest] == [batch.non_tensor_batch["uid"].tolist() for batch in expected[taken:]]


def test_the_state_after_an_epochs_last_batch_points_at_the_next_epoch(digits):
    loader = StatefulLoader(digits, 2, seed=5)
    loader.next_batch()
    assert {key: loader.state_dict()[key] for key in ("epoch", "position")} == {"epoch": 0, "position": 2}
    loader.next_batch()
    assert {key: loader.state_dict()[key] for key in ("epoch", "position")} == {"epoch": 1, "position": 0}


def test_a_state_from_another_dataset_is_refused(digits, write, tokenizer):
    other = RLDataset(write("other.parquet", [row(f"{i}=", str(i)) for i in (0, 1, 2, 3, 5)]), tokenizer)
    state = StatefulLoader(other, 2).state_dict()
    with pytest.raises(DataError, match=rf"checkpoint was taken over 5 prompts \(fingerprint {other.fingerprint}\), the training set now has 5 \(fingerprint {digits.fingerprint}\)"):
        StatefulLoader(digits, 2).load_state_dict(state)


def test_the_fingerprint_ignores_where_the_files_are(write, tokenizer):
    rows = [row(f"{i}=", str(i)) for i in range(3)]
    assert RLDataset(write("a.parquet", rows), tokenizer).fingerprint == RLDataset(write("b.parquet", rows), tokenizer).fingerprint


def test_a_state_with_another_seed_is_refused(digits):
    state = StatefulLoader(digits, 2, seed=1).state_dict()
    with pytest.raises(DataError, match=r"the checkpoint has data.seed=1, the config data.seed=2.*set data.seed=1 to resume"):
        StatefulLoader(digits, 2, seed=2).load_state_dict(state)


# -- the validation loader -------------------------------------------------------------------------------


def test_the_validation_loader_walks_the_set_in_order_from_the_start_each_time(digits):
    loader = ValidationLoader(digits, 2)
    assert len(loader) == 3
    assert indices(loader) == [[0, 1], [2, 3], [4]]
    assert indices(loader) == [[0, 1], [2, 3], [4]]
    assert next(iter(loader)).non_tensor_batch["uid"].tolist() == ["val-i0", "val-i1"]


def test_the_validation_loader_without_a_batch_size_gives_one_batch(digits):
    assert indices(ValidationLoader(digits)) == [[0, 1, 2, 3, 4]]


# -- config and loading ----------------------------------------------------------------------------------


def test_build_loaders_reads_the_data_node(write, tokenizer):
    train = write("train.parquet", [row(f"{i}=", str(i)) for i in range(4)])
    val = write("val.parquet", [row("9=", "9")])
    train_loader, val_loader = build_loaders(
        {"train_files": train, "val_files": [val], "train_batch_size": 2, "shuffle": False}, tokenizer
    )
    assert indices(train_loader) == [[0, 1], [2, 3]]
    assert [batch.batch["input_ids"].tolist() for batch in val_loader] == [[[1, 13, 15]]]


def test_without_val_files_there_is_no_validation_set(write, tokenizer):
    assert load_datasets(DataConfig(train_files=[write("train.parquet", [row()])]), tokenizer)[1] is None


def test_an_unknown_data_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'data.max_prompt_len'. Did you mean 'data.max_prompt_length'\?"):
        read_data_config({"train_files": [], "max_prompt_len": 4})


def test_an_unknown_truncation_policy_is_refused():
    with pytest.raises(DataError, match=r"data.truncation='middle' is not one of \['error', 'filter', 'left', 'right'\]"):
        DataConfig(truncation="middle")
