"""DataProto where verl's DataProto fixes the meaning: one behaviour per test, small hand-made batches.

Each expected value is worked out by hand from verl 0.9.1's ``verl/protocol.py`` (the behaviour code
ported from verl relies on) unless the test name says rlplat differs on purpose
(docs/verl-dataproto.md lists those differences).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlplat.protocol import (
    DataProto,
    DataProtoError,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)

NAN = float("nan")


def letters(meta=None) -> DataProto:
    """Rows a b c d: obs 10 20 30 40, label "a".."d"."""
    return DataProto.from_dict({"obs": torch.tensor([10, 20, 30, 40])}, {"label": ["a", "b", "c", "d"]}, meta or {"step": 1})


def obs(data: DataProto) -> list[int]:
    return data.batch["obs"].tolist()


# -- reorder: in place, like verl (its batch balancing drops the return value) -------------------------


def test_reorder_changes_the_receiver_and_returns_none():
    data = letters()
    result = data.reorder(torch.tensor([3, 0, 2, 1]))
    assert result is None
    assert obs(data) == [40, 10, 30, 20]
    assert data.non_tensor_batch["label"].tolist() == ["d", "a", "c", "b"]


def test_reorder_with_the_result_dropped_still_balances_the_batch():
    data = letters()
    data.reorder([1, 0, 3, 2])  # verl: `batch.reorder(global_idx)` in RayPPOTrainer._balance_batch
    assert obs(data) == [20, 10, 40, 30]


def test_reorder_keeps_meta_info():
    data = letters({"name": "x"})
    data.reorder([3, 2, 1, 0])
    assert data.meta_info == {"name": "x"}


def test_reorder_refuses_indices_that_are_not_a_permutation():
    data = letters()
    with pytest.raises(DataProtoError, match="permutation of the 4 rows; use select_idxs"):
        data.reorder([0, 0, 1, 2])
    assert obs(data) == [10, 20, 30, 40]


# -- concat: metrics gathered from every part ----------------------------------------------------------


def test_concat_gathers_metrics_given_as_a_list_of_dicts():
    first = letters({"metrics": [{"loss": 0.5, "accuracy": 0.9}]})
    second = letters({"metrics": [{"loss": 0.6, "accuracy": 0.85}]})
    assert DataProto.concat([first, second]).meta_info["metrics"] == {"loss": [0.5, 0.6], "accuracy": [0.9, 0.85]}


def test_concat_gathers_every_dict_of_a_metrics_list_in_order():
    first = letters({"metrics": [{"generate_s": 1.0}, {"generate_s": 2.0}]})  # one dict per sample
    second = letters({"metrics": [{"generate_s": 3.0}]})
    assert DataProto.concat([first, second]).meta_info["metrics"] == {"generate_s": [1.0, 2.0, 3.0]}


def test_concat_mixes_metrics_dicts_and_lists_of_dicts():
    first = letters({"metrics": {"loss": [0.5, 0.25]}})
    second = letters({"metrics": [{"loss": 0.125}]})
    assert DataProto.concat([first, second]).meta_info["metrics"] == {"loss": [0.5, 0.25, 0.125]}


def test_concat_keeps_metrics_when_the_first_part_has_none():
    first = letters({"flag": True})
    second = letters({"flag": True, "metrics": {"loss": 0.6}})
    third = letters({"flag": True, "metrics": None})
    assert DataProto.concat([first, second, third]).meta_info == {"flag": True, "metrics": {"loss": [0.6]}}


def test_concat_refuses_a_metrics_entry_that_is_not_a_dict():
    with pytest.raises(DataProtoError, match=r"part 1's meta_info\['metrics'\] holds a float"):
        DataProto.concat([letters({"metrics": [{"loss": 0.5}]}), letters({"metrics": [0.5]})])


def test_concat_conflict_is_both_a_value_error_and_an_assertion_error():
    with pytest.raises(DataProtoError) as raised:
        DataProto.concat([letters({"config": "A"}), letters({"config": "B"})])
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, AssertionError)
    assert "Conflicting values for meta_info key 'config'" in str(raised.value)


# -- union: equal copies are accepted, including NaN and arrays per row --------------------------------


def test_union_accepts_equal_copies_of_a_non_tensor_column_holding_nan():
    left = DataProto.from_dict(non_tensors={"score": np.array([1.0, NAN, 3.0])})
    right = DataProto.from_dict(non_tensors={"score": np.array([1.0, NAN, 3.0])})
    joined = left.union(right)
    np.testing.assert_array_equal(joined.non_tensor_batch["score"], np.array([1.0, NAN, 3.0]))


def test_union_accepts_equal_copies_of_an_object_column_holding_nan():
    left = DataProto.from_dict(non_tensors={"acc": [1.0, NAN]})
    assert left.union(DataProto.from_dict(non_tensors={"acc": [1.0, NAN]})).non_tensor_batch["acc"][0] == 1.0


def test_union_accepts_equal_copies_of_a_tensor_holding_nan():
    left = DataProto.from_dict({"values": torch.tensor([0.5, NAN])})
    joined = left.union(DataProto.from_dict({"values": torch.tensor([0.5, NAN])}))
    assert joined.batch["values"][0].item() == 0.5 and joined.batch["values"][1].isnan()


def test_union_refuses_nan_in_a_different_place():
    left = DataProto.from_dict(non_tensors={"score": np.array([1.0, NAN, 3.0])})
    right = DataProto.from_dict(non_tensors={"score": np.array([NAN, 1.0, 3.0])})
    with pytest.raises(DataProtoError, match="non_tensor_batch key 'score' is in both DataProtos with different values"):
        left.union(right)


def test_union_accepts_equal_copies_of_an_array_per_row():
    rows = [np.array([1, 2]), np.array([3, 4, 5])]
    left = DataProto.from_dict(non_tensors={"tool_ids": [row.copy() for row in rows]})
    right = DataProto.from_dict(non_tensors={"tool_ids": [row.copy() for row in rows]})
    assert left.union(right).non_tensor_batch["tool_ids"][1].tolist() == [3, 4, 5]


def test_union_refuses_an_array_per_row_that_differs():
    left = DataProto.from_dict(non_tensors={"tool_ids": [np.array([1, 2]), np.array([3, 4])]})
    right = DataProto.from_dict(non_tensors={"tool_ids": [np.array([1, 2]), np.array([3, 9])]})
    with pytest.raises(DataProtoError, match="'tool_ids'"):
        left.union(right)


def test_union_does_not_change_either_side():
    left, right = letters(), DataProto.from_dict({"values": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    left.union(right)
    assert left.tensor_keys() == ["obs"] and right.tensor_keys() == ["values"]


def test_union_tensor_dict_merges_into_its_first_argument_and_returns_it():
    first = TensorDict({"obs": torch.tensor([1, 2])}, batch_size=[2])
    second = TensorDict({"obs": torch.tensor([1, 2]), "rew": torch.tensor([0.5, 1.5])}, batch_size=[2])
    assert union_tensor_dict(first, second) is first
    assert sorted(first.keys()) == ["obs", "rew"] and first["rew"].tolist() == [0.5, 1.5]


def test_union_tensor_dict_refuses_a_column_that_differs():
    first = TensorDict({"obs": torch.tensor([1, 2])}, batch_size=[2])
    with pytest.raises(AssertionError, match="batch key 'obs'"):
        union_tensor_dict(first, TensorDict({"obs": torch.tensor([1, 3])}, batch_size=[2]))


def test_union_numpy_dict_merges_into_its_first_argument_and_returns_it():
    first = {"a": np.array([1.0, NAN])}
    result = union_numpy_dict(first, {"a": np.array([1.0, NAN]), "b": np.array(["x", "y"], dtype=object)})
    assert result is first and sorted(first) == ["a", "b"] and first["b"].tolist() == ["x", "y"]


def test_union_numpy_dict_compares_self_referencing_arrays_without_recursing_forever():
    first, second = np.array([None], dtype=object), np.array([None], dtype=object)
    first[0], second[0] = first, second
    union_numpy_dict({"data": first}, {"data": second})
    with pytest.raises(AssertionError, match="`data` in tensor_dict1 and tensor_dict2"):
        union_numpy_dict({"data": first}, {"data": np.array([None], dtype=object)})


def test_union_numpy_dict_refuses_equal_values_of_another_dtype():
    with pytest.raises(DataProtoError):
        union_numpy_dict({"n": np.array([1, 2], dtype=np.int32)}, {"n": np.array([1, 2], dtype=np.int64)})


# -- to_tensordict / from_tensordict (verl 0.9's trainer format) ---------------------------------------


def test_to_tensordict_puts_rows_in_stacks_and_meta_info_in_non_tensor_data():
    data = DataProto.from_dict({"obs": torch.tensor([1, 2])}, {"turns": [[], [0.5, 0.8]]}, {"global_steps": 42})
    output = data.to_tensordict()
    assert output.batch_size == torch.Size([2])
    assert isinstance(output.get("turns"), NonTensorStack) and isinstance(output.get("global_steps"), NonTensorData)
    assert output["obs"].tolist() == [1, 2]
    assert output["turns"] == [[], [0.5, 0.8]]
    assert output["global_steps"] == 42


def test_to_tensordict_shares_tensor_storage():
    data = letters()
    assert data.to_tensordict()["obs"].data_ptr() == data.batch["obs"].data_ptr()


def test_to_tensordict_refuses_a_key_in_two_parts():
    data = DataProto.from_dict({"obs": torch.tensor([1, 2])}, meta_info={"obs": "also here"})
    with pytest.raises(DataProtoError, match=r"meta_info key\(s\) \['obs'\]"):
        data.to_tensordict()


def test_from_tensordict_round_trip_keeps_a_list_per_row_as_one_object():
    data = DataProto.from_dict(
        {"obs": torch.tensor([1, 2])},
        {"raw_prompt": [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "3+3?"}]]},
        {"experiment": "e1"},
    )
    restored = DataProto.from_tensordict(data.to_tensordict())
    assert restored.batch["obs"].tolist() == [1, 2]
    assert restored.non_tensor_batch["raw_prompt"].shape == (2,)
    assert restored.non_tensor_batch["raw_prompt"][1] == [{"role": "user", "content": "3+3?"}]
    assert restored.meta_info == {"experiment": "e1"}


# -- row helpers ---------------------------------------------------------------------------------------


def test_sample_level_repeat_repeats_each_row_its_own_number_of_times():
    repeated = letters().sample_level_repeat([2, 0, 1, 3])
    assert obs(repeated) == [10, 10, 30, 40, 40, 40]
    assert repeated.non_tensor_batch["label"].tolist() == ["a", "a", "c", "d", "d", "d"]


def test_sample_level_repeat_needs_one_count_per_row():
    with pytest.raises(DataProtoError, match=r"one non-negative int per row \(4\)"):
        letters().sample_level_repeat(torch.tensor([1, 2]))


def test_fold_batch_dim_groups_consecutive_rows_without_changing_its_input():
    data = letters()
    folded = fold_batch_dim(data, new_batch_size=2)
    assert folded.batch["obs"].tolist() == [[10, 20], [30, 40]]
    assert folded.non_tensor_batch["label"].tolist() == [["a", "b"], ["c", "d"]]
    assert data.non_tensor_batch["label"].shape == (4,)


def test_unfold_batch_dim_undoes_fold_batch_dim_after_a_reorder():
    folded = fold_batch_dim(letters(), new_batch_size=2)
    folded.reorder([1, 0])
    unfolded = unfold_batch_dim(folded, batch_dims=2)
    assert obs(unfolded) == [30, 40, 10, 20]
    assert unfolded.non_tensor_batch["label"].tolist() == ["c", "d", "a", "b"]


def test_unfold_column_chunks_splits_a_list_per_row_into_rows():
    """rlplat differs on purpose: a list row stays a list (verl's test builds a 2-D object array)."""
    data = DataProto.from_dict({"ids": torch.tensor([[1, 2], [3, 4]])}, {"labels": [["a1", "a2"], ["b1", "b2"]], "uid": ["a", "b"]})
    unfolded = data.unfold_column_chunks(2, split_keys=["ids", "labels"])
    assert unfolded.batch["ids"].tolist() == [[1], [2], [3], [4]]
    assert unfolded.non_tensor_batch["labels"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"]]
    assert unfolded.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]


def test_verl_padding_functions_are_the_one_padding_mechanism():
    padded, pad_size = pad_dataproto_to_divisor(letters(), size_divisor=3)
    assert (obs(padded), pad_size) == ([10, 20, 30, 40, 10, 20], 2)
    assert obs(unpad_dataproto(padded, pad_size=pad_size)) == [10, 20, 30, 40]


# -- construction arguments verl has --------------------------------------------------------------------


def test_from_dict_refuses_more_than_one_batch_dimension():
    with pytest.raises(AssertionError, match="num_batch_dims=2"):
        DataProto.from_dict({"obs": torch.zeros(2, 3)}, num_batch_dims=2)


def test_from_dict_refuses_verls_auto_padding():
    with pytest.raises(DataProtoError, match="pad_to_divisor"):
        DataProto.from_dict({"obs": torch.zeros(2)}, auto_padding=True)


def test_from_single_dict_builds_the_subclass_it_is_called_on():
    class Batch(DataProto):
        pass

    assert type(Batch.from_single_dict({"x": torch.tensor([0])})) is Batch


# -- make_iterator: a seed alone does not shuffle (verl's DataLoader default) ---------------------------


def test_make_iterator_with_only_a_seed_keeps_row_order():
    assert [obs(part) for part in letters().make_iterator(2, epochs=1, seed=7)] == [[10, 20], [30, 40]]


def test_make_iterator_shuffles_when_dataloader_kwargs_ask():
    parts = [obs(part) for part in letters().make_iterator(4, epochs=1, seed=0, dataloader_kwargs={"shuffle": True})]
    expected = letters().batch["obs"][torch.randperm(4, generator=torch.Generator().manual_seed(0))].tolist()
    assert parts == [expected]


def test_make_iterator_refuses_dataloader_kwargs_it_cannot_honour():
    with pytest.raises(TypeError, match=r"\['num_workers'\] are not supported"):
        letters().make_iterator(2, dataloader_kwargs={"num_workers": 2})


# -- serialization helpers (verl's format; no pickled code) ---------------------------------------------


def test_single_tensor_round_trip_is_bit_exact_and_owns_its_memory():
    tensor = torch.tensor([[1.5, -2.0], [NAN, 3.25]]).bfloat16()
    dtype, shape, data = serialize_single_tensor(tensor)
    assert (dtype, shape) == ("bfloat16", (2, 2))
    restored = deserialize_single_tensor((dtype, shape, data))
    assert restored.dtype == torch.bfloat16 and torch.equal(restored.view(torch.int16), tensor.view(torch.int16))
    assert restored.data_ptr() != tensor.data_ptr()


def test_deserialize_single_tensor_refuses_a_name_that_is_not_a_dtype():
    with pytest.raises(DataProtoError, match="dtype 'load', which is not a torch dtype"):
        deserialize_single_tensor(("load", (1,), b"\x00"))


def test_tensordict_round_trip_keeps_nested_tensors_and_nested_keys():
    nested = torch.nested.as_nested_tensor([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], layout=torch.jagged)
    original = TensorDict({"ragged": nested, "extra": {"mask": torch.tensor([True, False])}}, batch_size=[2])
    restored = deserialize_tensordict(serialize_tensordict(original))
    assert restored.batch_size == torch.Size([2])
    assert [t.tolist() for t in restored["ragged"].unbind()] == [[1.0, 2.0], [3.0]]
    assert restored["extra", "mask"].tolist() == [True, False]


def test_getstate_and_setstate_round_trip_into_an_empty_dataproto():
    data = letters({"step": 3})
    restored = DataProto()
    restored.__setstate__(data.__getstate__())
    assert obs(restored) == [10, 20, 30, 40] and restored.non_tensor_batch["label"].tolist() == ["a", "b", "c", "d"]
    assert restored.meta_info == {"step": 3}


def test_pickling_an_empty_tensordict_keeps_its_batch_size():
    restored = pickle.loads(pickle.dumps(DataProto(batch=TensorDict({}, batch_size=[5]))))
    assert restored.batch.batch_size == torch.Size([5]) and len(restored.batch.keys()) == 0
