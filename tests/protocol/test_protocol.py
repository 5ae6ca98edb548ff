"""DataProto: properties over random sizes (hypothesis), exact round trips, and the padding rule."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rlplat.protocol import DataProto, merge_meta_info

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=40, deadline=None)


def numbered(rows: int, meta=None) -> DataProto:
    """Row i holds i in every column, so any reordering or loss of rows shows."""
    ids = torch.arange(rows)
    return DataProto.from_dict(
        tensors={"input_ids": ids[:, None].repeat(1, 3), "old_log_probs": ids.float()[:, None] / 10},
        non_tensors={"uid": [f"u{i}" for i in range(rows)]},
        meta_info=meta or {"temperature": 0.7},
    )


def row_ids(data: DataProto) -> list[int]:
    assert data.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in data.batch["input_ids"][:, 0].tolist()]
    return data.batch["input_ids"][:, 0].tolist()


@FAST
@given(rows=st.integers(0, 40), chunks=st.integers(1, 10))
def test_chunk_gives_exactly_n_near_equal_parts_that_concat_back(rows, chunks):
    data = numbered(rows)
    parts = data.chunk(chunks)
    sizes = [len(part) for part in parts]
    assert len(parts) == chunks and sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert row_ids(DataProto.concat(parts)) == list(range(rows))


@FAST
@given(rows=st.integers(1, 40), split_size=st.integers(1, 12))
def test_split_gives_parts_of_split_size_and_a_shorter_last(rows, split_size):
    parts = numbered(rows).split(split_size)
    assert [len(p) for p in parts[:-1]] == [split_size] * (len(parts) - 1)
    assert 1 <= len(parts[-1]) <= split_size
    assert row_ids(DataProto.concat(parts)) == list(range(rows))


@FAST
@given(rows=st.integers(0, 20), times=st.integers(1, 5))
def test_repeat_interleaved_and_tiled(rows, times):
    data = numbered(rows)
    assert row_ids(data.repeat(times, interleave=True)) == [i for i in range(rows) for _ in range(times)]
    assert row_ids(data.repeat(times, interleave=False)) == [i for _ in range(times) for i in range(rows)]


@FAST
@given(rows=st.integers(1, 30), divisor=st.integers(1, 9))
def test_pad_to_divisor_repeats_leading_rows_and_unpad_restores_exactly(rows, divisor):
    data = numbered(rows)
    padded, pad_size = data.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0 and 0 <= pad_size < divisor
    assert row_ids(padded) == list(range(rows)) + [i % rows for i in range(pad_size)]
    assert padded.meta_info == data.meta_info
    assert row_ids(padded.unpad(pad_size)) == list(range(rows))


def test_an_empty_batch_already_divides_by_anything():
    padded, pad_size = DataProto.from_dict({"x": torch.zeros(0, 2)}).pad_to_divisor(4)
    assert (len(padded), pad_size) == (0, 0)


@FAST
@given(mask=st.lists(st.booleans(), min_size=1, max_size=25))
def test_boolean_masks_and_index_arrays_select_rows_in_order(mask):
    data = numbered(len(mask))
    expected = [i for i, keep in enumerate(mask) if keep]
    assert row_ids(data[np.array(mask)]) == expected
    assert row_ids(data[torch.tensor(mask)]) == expected
    assert row_ids(data.select_idxs(expected[::-1])) == expected[::-1]


@FAST
@given(rows=st.integers(1, 20), start=st.integers(-25, 25), stop=st.integers(-25, 25), step=st.integers(1, 3))
def test_slices_behave_like_list_slices(rows, start, stop, step):
    assert row_ids(numbered(rows)[start:stop:step]) == list(range(rows))[start:stop:step]


def test_integer_index_gives_one_row():
    item = numbered(4)[2]
    assert item.batch["input_ids"].tolist() == [2, 2, 2]
    assert item.non_tensor_batch == {"uid": "u2"}
    with pytest.raises(IndexError, match="row 4 out of range"):
        numbered(4)[4]


def test_select_keeps_only_the_named_keys_and_names_missing_ones():
    data = numbered(3)
    chosen = data.select(batch_keys=["input_ids"], non_tensor_batch_keys=[], meta_info_keys=["temperature"])
    assert chosen.tensor_keys() == ["input_ids"] and chosen.non_tensor_batch == {}
    with pytest.raises(KeyError, match="responses"):
        data.select(batch_keys=["responses"])


def test_pop_removes_from_the_receiver_and_returns_what_it_removed():
    data = numbered(3)
    popped = data.pop(batch_keys=["old_log_probs"], non_tensor_batch_keys=["uid"])
    assert data.tensor_keys() == ["input_ids"] and "uid" not in data.non_tensor_batch
    assert popped.tensor_keys() == ["old_log_probs"] and popped.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]


def test_union_joins_keys_without_touching_either_side():
    left = numbered(3)
    right = DataProto.from_dict({"values": torch.ones(3, 2), "input_ids": left.batch["input_ids"].clone()}, {"tag": ["a", "b", "c"]})
    joined = left.union(right)
    assert sorted(joined.tensor_keys()) == ["input_ids", "old_log_probs", "values"]
    assert sorted(joined.non_tensor_batch) == ["tag", "uid"]
    assert sorted(left.tensor_keys()) == ["input_ids", "old_log_probs"] and "tag" not in left.non_tensor_batch


@pytest.mark.parametrize("part", ["batch", "non_tensor_batch", "meta_info"])
def test_union_with_a_conflicting_key_names_it(part):
    left = numbered(2)
    right = {
        "batch": DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)}),
        "non_tensor_batch": DataProto.from_dict(non_tensors={"uid": ["other", "u1"]}),
        "meta_info": DataProto.from_dict(non_tensors={"uid": ["u0", "u1"]}, meta_info={"temperature": 1.0}),
    }[part]
    with pytest.raises(ValueError, match=f"{part} key '(input_ids|uid|temperature)'"):
        left.union(right)


def test_rename_returns_a_new_object():
    data = numbered(2)
    renamed = data.rename("old_log_probs", "ref_log_prob")
    assert sorted(renamed.tensor_keys()) == ["input_ids", "ref_log_prob"]
    assert sorted(data.tensor_keys()) == ["input_ids", "old_log_probs"]


def test_reorder_reorders_in_place_and_returns_none_as_verl_does():
    data = numbered(3)
    assert data.reorder([2, 0, 1]) is None
    assert row_ids(data) == [2, 0, 1]


def test_select_idxs_gives_a_reordered_new_object():
    data = numbered(3)
    assert row_ids(data.select_idxs([2, 0, 1])) == [2, 0, 1] and row_ids(data) == [0, 1, 2]


@FAST
@given(batches=st.integers(1, 6), size=st.integers(1, 5), epochs=st.integers(1, 3), seed=st.integers(0, 1000))
def test_make_iterator_shuffles_deterministically_under_a_seed_and_covers_each_epoch(batches, size, epochs, seed):
    data = numbered(batches * size)
    first = [row_ids(mb) for mb in data.make_iterator(size, epochs=epochs, seed=seed, shuffle=True)]
    second = [row_ids(mb) for mb in data.make_iterator(size, epochs=epochs, seed=seed, shuffle=True)]
    assert first == second and len(first) == batches * epochs
    for epoch in range(epochs):
        rows = sum(first[epoch * batches : (epoch + 1) * batches], [])
        assert sorted(rows) == list(range(batches * size))


def test_make_iterator_without_seed_keeps_order_and_rejects_uneven_sizes():
    assert [row_ids(mb) for mb in numbered(4).make_iterator(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="5 rows do not split into mini-batches of 2"):
        numbered(5).make_iterator(2)


def test_concat_gathers_metrics_and_rejects_conflicting_meta_info():
    first = numbered(1, meta={"temperature": 1.0, "metrics": {"loss": 0.5}})
    second = numbered(1, meta={"temperature": 1.0, "metrics": {"loss": [0.25, 0.125]}, "step": 3})
    assert DataProto.concat([first, second]).meta_info == {"temperature": 1.0, "step": 3, "metrics": {"loss": [0.5, 0.25, 0.125]}}
    with pytest.raises(ValueError, match="Conflicting values for meta_info key 'temperature'"):
        merge_meta_info([{"temperature": 1.0}, {"temperature": 0.5}])


def test_inconsistent_lengths_are_rejected_with_the_key():
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has 2 rows, the batch has 3"):
        DataProto.from_dict({"x": torch.zeros(3)}, {"uid": ["a", "b"]})
    with pytest.raises(ValueError, match="same first"):
        DataProto.from_dict({"x": torch.zeros(3), "y": torch.zeros(2)})


def rich_batch() -> DataProto:
    generator = torch.Generator().manual_seed(0)
    nested = TensorDict({"mask": torch.tensor([[True, False], [False, True], [True, True]])}, batch_size=[3])
    return DataProto.from_dict(
        tensors={
            "float32": torch.randn(3, 4, generator=generator),
            "bfloat16": torch.randn(3, 4, generator=generator).bfloat16(),
            "int64": torch.randint(-(2**62), 2**62, (3, 5), generator=generator),
            "bool": torch.rand(3, 2, generator=generator) > 0.5,
            "extra": nested,
        },
        non_tensors={
            "uid": ["a", "b", "c"],
            "reward_model": [{"ground_truth": "4", "style": "rule"}, {"ground_truth": "x"}, {}],
            "messages": [[{"role": "user", "content": "hi"}], [], ["a", 1, 2.5]],
            "scores": np.array([0.5, 1.0, -2.0]),
        },
        meta_info={"temperature": 0.9, "metrics": {"loss": [1.0]}},
    )


def assert_identical(left: DataProto, right: DataProto) -> None:
    assert sorted(map(str, left.tensor_keys())) == sorted(map(str, right.tensor_keys()))
    for key in left.tensor_keys():
        a, b = left.batch.get(key), right.batch.get(key)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    assert left.non_tensor_batch.keys() == right.non_tensor_batch.keys()
    for key, value in left.non_tensor_batch.items():
        assert value.dtype == right.non_tensor_batch[key].dtype and value.tolist() == right.non_tensor_batch[key].tolist(), key
    assert left.meta_info == right.meta_info


def empty_batch() -> DataProto:
    return DataProto.from_dict({"input_ids": torch.zeros(0, 8, dtype=torch.long)}, {"uid": []})


def non_tensor_only() -> DataProto:
    return DataProto.from_dict(non_tensors={"raw_prompt": ["what is 2+2?", "and 3+3?"]}, meta_info={"split": "val"})


@pytest.mark.parametrize("make", [rich_batch, empty_batch, non_tensor_only], ids=["rich", "empty", "non-tensor-only"])
@pytest.mark.parametrize("route", ["in-band", "out-of-band", "disk"])
def test_serialization_round_trips_bit_exact(make, route, tmp_path):
    data = make()
    if route == "in-band":
        restored = pickle.loads(pickle.dumps(data, protocol=5))
    elif route == "out-of-band":
        buffers = []
        payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
        restored = pickle.loads(payload, buffers=buffers)
    else:
        data.save_to_disk(tmp_path / "batch.dp")
        restored = DataProto.load_from_disk(tmp_path / "batch.dp")
    assert len(restored) == len(data)
    assert_identical(data, restored)


def test_out_of_band_pickling_hands_over_every_tensor_without_copying():
    data = rich_batch()
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    tensor_bytes = sum(data.batch.get(k).numel() * data.batch.get(k).element_size() for k in data.tensor_keys())
    assert sum(buffer.raw().nbytes for buffer in buffers) >= tensor_bytes
    assert len(payload) < 2000
    restored = pickle.loads(payload, buffers=buffers)
    # the restored tensors are views of the buffers the receiver was given
    float_buffer = next(b for b in buffers if b.raw().nbytes == 3 * 4 * 4 and np.frombuffer(b.raw(), np.float32)[0] == data.batch["float32"][0, 0].item())
    assert restored.batch["float32"].data_ptr() == np.frombuffer(float_buffer.raw(), np.uint8).ctypes.data


def test_loading_from_disk_refuses_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (subprocess.call, (["true"],))

    (tmp_path / "evil.dp").write_bytes(pickle.dumps(DataProto.from_dict(non_tensors={"x": [Payload()]}), protocol=5))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load subprocess.call"):
        DataProto.load_from_disk(tmp_path / "evil.dp")


def test_no_code_in_the_project_loads_pickled_code_from_tensors():
    offenders = []
    for path in list(ROOT.glob("core/**/*.py")) + list(ROOT.glob("plugins/**/*.py")) + list(ROOT.glob("bench/**/*.py")):
        text = path.read_text()
        if "weights_only=False" in text.replace(" ", "") or "weights_only = False" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
