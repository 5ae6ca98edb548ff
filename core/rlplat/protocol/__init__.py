"""``DataProto``: the one batch container that moves between the driver and the workers.

Three parts: ``batch`` (a ``tensordict.TensorDict`` with one batch dimension), ``non_tensor_batch``
(str -> numpy array of the same length, usually ``dtype=object``) and ``meta_info`` (a dict that is
not split). Method and function names follow verl's ``verl.protocol`` and keep its meaning, so code
ports over; verl 0.9.1's own DataProto tests run against this module (``make test-verl-compat``,
plugins/compat/verl/docs/verl-dataproto.md). Where rlplat behaves differently it says so here:

- Operations return new objects that share tensor storage; none modifies its receiver. The
  exceptions, each verl's meaning: :meth:`DataProto.pop` (like ``dict.pop``) removes what it returns;
  :meth:`DataProto.reorder` reorders in place and returns None (:meth:`DataProto.select_idxs` gives a
  reordered new object); the module functions :func:`union_tensor_dict` and :func:`union_numpy_dict`
  merge into their first argument. verl's ``union``, ``rename`` and ``to`` modify their receiver and
  return it; here they return a new object, so use the returned value (verl's own code always does).
- There is one padding mechanism, :meth:`pad_to_divisor` / :meth:`unpad`
  (:func:`pad_dataproto_to_divisor` / :func:`unpad_dataproto` under verl's names); dispatch uses the
  same one. verl's ``auto_padding`` is refused.
- :meth:`union` raises on a key both sides hold with different values; equal copies are accepted,
  NaN in the same place counting as equal. :meth:`concat` merges ``meta_info`` by
  :func:`merge_meta_info` (metrics gathered).
- A list per row stays one object per row in ``non_tensor_batch`` (verl's ``np.array(dtype=object)``
  turns equal-length rows into a 2-D array); :meth:`chunk` gives exactly n near-equal parts where
  verl refuses a length that does not divide.
- Errors about the data are :class:`DataProtoError`: a ``ValueError`` that is also an
  ``AssertionError``, because verl signals the same conditions with ``assert``.
- Pickling (protocol 5) hands every tensor and numeric numpy array over as an out-of-band buffer, so
  the Ray object store maps them instead of copying. A consequence: tensors of a DataProto that came
  out of ``ray.get`` are views of the shared object store; clone a tensor before changing it in place.
- :meth:`load_from_disk` never unpickles arbitrary code: tensors are raw bytes, and the unpickler
  only admits the numpy and builtin types a batch holds.

verl's module-level helpers are importable from here too (``from verl.protocol import X`` ports to
``from rlplat.protocol import X``): the value helpers live in :mod:`rlplat.protocol.values`, tensor
serialization in :mod:`rlplat.protocol.tensors`.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

__all__ = [
    "DataProto", "DataProtoError", "DataProtoItem", "deserialize_single_tensor", "deserialize_tensordict",
    "fold_batch_dim", "load_data_proto_bytes", "merge_meta_info", "pad_dataproto_to_divisor",
    "serialize_single_tensor", "serialize_tensordict", "unfold_batch_dim", "union_numpy_dict",
    "union_tensor_dict", "unpad_dataproto"
]

from rlplat.protocol.tensors import (deserialize_single_tensor, deserialize_tensordict, serialize_single_tensor,  # noqa: F401
                                     serialize_tensordict, tensor_from_bytes)
from rlplat.protocol.values import (METRICS_KEY, DataProtoError, as_object_array, is_nan, merge_meta_info,  # noqa: F401
                                    tensors_equal, union_numpy_dict, union_tensor_dict, values_equal)

FORMAT_VERSION = 1



def to_index_tensor(indices: Any, length: int) -> torch.Tensor:
    """An int64 index tensor from a list, range, numpy array or tensor of ints, or a boolean mask."""
    if isinstance(indices, torch.Tensor):
        index = indices.detach().cpu()
    else:
        index = torch.as_tensor(np.asarray(indices))
    if index.dtype == torch.bool:
        if index.shape != (length,):
            raise IndexError(f"boolean mask of shape {tuple(index.shape)} does not match a DataProto of {length} rows")
        return index.nonzero().flatten()
    if index.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if index.dtype.is_floating_point or index.dim() != 1:
        raise IndexError(f"indices must be a 1-D array of ints or a boolean mask, got {index.dtype} of shape {tuple(index.shape)}")
    index = index.long()
    if length and (index.max() >= length or index.min() < -length):
        raise IndexError(f"index out of range for a DataProto of {length} rows")
    if not length:
        raise IndexError("index out of range for an empty DataProto")
    return torch.where(index < 0, index + length, index)


def refuse_auto_padding(auto_padding: bool) -> None:
    if auto_padding:
        raise DataProtoError(
            "auto_padding is verl's second padding mechanism; rlplat has one: pad with "
            "data.pad_to_divisor(divisor) and drop it with unpad(pad_size) (dispatch does both for you)"
        )


@dataclasses.dataclass
class DataProtoItem:
    """One row: ``batch`` without the batch dimension, one value per non-tensor key, shared meta_info."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any]


class DataProto:
    """See the module docstring. Construct with :meth:`from_dict` or :meth:`from_single_dict`."""

    __slots__ = ("batch", "non_tensor_batch", "meta_info")

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: Mapping[str, np.ndarray] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ):
        self.batch = batch
        self.non_tensor_batch = dict(non_tensor_batch or {})
        self.meta_info = dict(meta_info or {})
        self.check_consistency()

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> "DataProto":
        """Build from ``tensors`` (all with the same first dimension) and ``non_tensors`` (sequences of
        that length, turned into numpy object arrays unless already numpy arrays).

        ``num_batch_dims`` and ``auto_padding`` are verl's arguments: a DataProto has exactly one batch
        dimension, and padding is :meth:`pad_to_divisor`'s job, so anything but ``1`` and ``False``
        raises :class:`DataProtoError`.
        """
        if num_batch_dims != 1:
            raise DataProtoError(
                f"from_dict: num_batch_dims={num_batch_dims}, but a DataProto has exactly one batch dimension "
                "(fold rows into groups with fold_batch_dim instead)"
            )
        refuse_auto_padding(auto_padding)
        tensors = dict(tensors or {})
        non_tensor_batch = {key: as_object_array(value) for key, value in (non_tensors or {}).items()}
        batch = None
        if tensors:
            sizes = {key: value.shape[0] if value.dim() else None for key, value in tensors.items()}
            first = next(iter(sizes.values()))
            if any(size != first for size in sizes.values()) or first is None:
                raise DataProtoError(f"every tensor needs the same first (batch) dimension; got {sizes}")
            batch = TensorDict(tensors, batch_size=[first])
        return cls(batch, non_tensor_batch, meta_info)

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None, auto_padding: bool = False
    ) -> "DataProto":
        """Build from one dict: tensors go to ``batch``, numpy arrays and lists to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        for key, value in others.items():
            if not isinstance(value, (np.ndarray, list, tuple)):
                raise TypeError(f"from_single_dict: {key!r} is a {type(value).__name__}, not a tensor, array or list")
        return cls.from_dict(tensors, others, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: Mapping[str, Any] | None = None, num_batch_dims: int = 1
    ) -> "DataProto":
        """The inverse of :meth:`to_tensordict`: tensors (and nested TensorDicts) go to ``batch``, each
        ``NonTensorStack`` to a ``non_tensor_batch`` column (one object per row), each ``NonTensorData``
        to ``meta_info`` (added to a copy of ``meta_info``)."""
        if num_batch_dims != 1:
            raise DataProtoError(f"from_tensordict: num_batch_dims={num_batch_dims}; a DataProto has one batch dimension")
        meta = dict(meta_info or {})
        tensors: dict[str, Any] = {}
        non_tensor: dict[str, np.ndarray] = {}
        for key, value in tensor_dict.items():
            if isinstance(value, NonTensorStack):
                non_tensor[key] = as_object_array([element.data for element in value])
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            else:
                tensors[key] = value
        batch = None
        if tensors:
            batch = TensorDict(tensors, batch_size=tensor_dict.batch_size[:1], device=tensor_dict.device)
        return cls(batch, non_tensor, meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict with one batch dimension holding everything (verl 0.9's trainer format):
        tensors as they are, each ``non_tensor_batch`` column as a ``NonTensorStack`` of one
        ``NonTensorData`` per row, each ``meta_info`` key as a ``NonTensorData``. Tensors are shared,
        not copied. A key in two parts raises :class:`DataProtoError`."""
        source: dict[str, Any] = dict(self.batch.items()) if self.batch is not None else {}
        for part, items in (("non_tensor_batch", self.non_tensor_batch), ("meta_info", self.meta_info)):
            clashes = sorted(set(items) & set(source))
            if clashes:
                raise DataProtoError(f"to_tensordict: {part} key(s) {clashes} are also batch or non_tensor_batch keys")
            for key, value in items.items():
                if part == "meta_info":
                    source[key] = NonTensorData(value)
                else:
                    source[key] = NonTensorStack.from_list([NonTensorData(row) for row in value])
        device = self.batch.device if self.batch is not None else None
        return TensorDict(source, batch_size=[len(self)], device=device)

    def check_consistency(self) -> None:
        """Raise :class:`DataProtoError` (naming the key) unless every column has the same number of rows."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise DataProtoError(f"DataProto.batch must have exactly one batch dimension, got {self.batch.batch_size}")
        length = self.batch.batch_size[0] if self.batch is not None else None
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value).__name__}")
            if length is None:
                length = len(value)
            elif len(value) != length:
                raise DataProtoError(f"non_tensor_batch[{key!r}] has {len(value)} rows, the batch has {length}")

    # -- size and access ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __repr__(self) -> str:
        keys = list(self.batch.keys(include_nested=True, leaves_only=True)) if self.batch is not None else []
        return (
            f"DataProto(rows={len(self)}, tensors={keys}, non_tensors={list(self.non_tensor_batch)}, "
            f"meta_info={list(self.meta_info)})"
        )

    def __getitem__(self, item: Any) -> "DataProto | DataProtoItem":
        """``int`` -> :class:`DataProtoItem`; ``slice``, index array or boolean mask -> DataProto."""
        if isinstance(item, (int, np.integer)):
            length = len(self)
            if not -length <= item < length:
                raise IndexError(f"row {item} out of range for a DataProto of {length} rows")
            row = int(item)
            return DataProtoItem(
                self.batch[row] if self.batch is not None else None,
                {key: value[row] for key, value in self.non_tensor_batch.items()},
                self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        return self.select_idxs(item)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        """Rows ``start:end:step`` as views (no copy)."""
        window = slice(start, end, step)
        batch = self.batch[window] if self.batch is not None else None
        non_tensor = {key: value[window] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch, non_tensor, self.meta_info)

    def select_idxs(self, idxs: Any) -> "DataProto":
        """Rows at ``idxs`` (ints, in that order, repeats allowed) or where a boolean mask is True."""
        index = to_index_tensor(idxs, len(self))
        batch = self.batch[index] if self.batch is not None else None
        numpy_index = index.numpy()
        non_tensor = {key: value[numpy_index] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch, non_tensor, self.meta_info)

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> "DataProto":
        """A DataProto with only these keys (None keeps all of that part); ``deepcopy`` copies data.
        A key that is not there raises ``KeyError`` (verl silently skips missing non-tensor and meta keys)."""
        batch = self.batch
        if batch_keys is not None and batch is not None:
            self._require(batch_keys, self.tensor_keys(), "batch")
            batch = batch.select(*batch_keys)
        elif batch_keys is not None and batch_keys:
            raise KeyError(f"select: batch keys {list(batch_keys)} requested from a DataProto without tensors")
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            self._require(non_tensor_batch_keys, non_tensor.keys(), "non_tensor_batch")
            non_tensor = {key: non_tensor[key] for key in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            self._require(meta_info_keys, meta.keys(), "meta_info")
            meta = {key: meta[key] for key in meta_info_keys}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        return type(self)(batch, non_tensor, meta)

    @staticmethod
    def _require(wanted: Sequence[str], present: Any, part: str) -> None:
        missing = [key for key in wanted if key not in set(present)]
        if missing:
            raise KeyError(f"{part} has no key(s) {missing}; it holds {sorted(map(str, present))}")

    def tensor_keys(self) -> list[Any]:
        """The batch's keys, nested ones as tuples."""
        if self.batch is None:
            return []
        return list(self.batch.keys(include_nested=True, leaves_only=True))

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> "DataProto":
        """Remove these keys from this DataProto and return them as a new one (modifies its receiver,
        like ``dict.pop`` and verl's ``pop``)."""
        popped = self.select(batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or [])
        if self.batch is not None and batch_keys:
            self.batch = self.batch.exclude(*batch_keys)
        for key in non_tensor_batch_keys or []:
            del self.non_tensor_batch[key]
        for key in meta_info_keys or []:
            del self.meta_info[key]
        return popped

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> "DataProto":
        """A DataProto whose batch keys ``old_keys`` are called ``new_keys`` (verl renames its receiver
        and returns it; use the returned value)."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise DataProtoError(f"rename: {len(old)} old keys but {len(new)} new keys")
        if self.batch is None:
            raise KeyError(f"rename: no tensors to rename ({old})")
        self._require(old, self.batch.keys(), "batch")
        batch = self.batch.clone(recurse=False)
        for source, target in zip(old, new):
            batch.rename_key_(source, target)
        return type(self)(batch, self.non_tensor_batch, self.meta_info)

    def union(self, other: "DataProto") -> "DataProto":
        """A new DataProto with all keys of both; neither side changes (verl's union changes its
        receiver and returns it; use the returned value). A key both hold must have equal values
        (NaN in the same place counts as equal), else :class:`DataProtoError` naming it; meta_info
        follows the same rule."""
        if len(self) != len(other) and (self.batch is not None or self.non_tensor_batch) and (
            other.batch is not None or other.non_tensor_batch
        ):
            raise DataProtoError(f"union of DataProtos with {len(self)} and {len(other)} rows")
        batch = self.batch
        if other.batch is not None:
            batch = other.batch if batch is None else union_tensor_dict(batch.clone(recurse=False), other.batch)
        non_tensor = dict(self.non_tensor_batch)
        meta = dict(self.meta_info)
        for part, merged, added in (("non_tensor_batch", non_tensor, other.non_tensor_batch), ("meta_info", meta, other.meta_info)):
            for key, value in added.items():
                if key not in merged:
                    merged[key] = value
                elif not values_equal(merged[key], value):
                    raise DataProtoError(f"union: {part} key {key!r} is in both DataProtos with different values")
        return type(self)(batch, non_tensor, meta)

    # -- splitting and joining ---------------------------------------------------------------------------

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Exactly ``chunks`` parts of near-equal size, the first ``len % chunks`` one row longer
        (``np.array_split``'s rule; verl refuses a length that ``chunks`` does not divide)."""
        if chunks < 1:
            raise DataProtoError(f"chunk: chunks must be >= 1, got {chunks}")
        base, extra = divmod(len(self), chunks)
        sizes = [base + (1 if i < extra else 0) for i in range(chunks)]
        return self._split_sizes(sizes)

    def split(self, split_size: int) -> list["DataProto"]:
        """Parts of ``split_size`` rows (the last may be shorter)."""
        if split_size < 1:
            raise DataProtoError(f"split: split_size must be >= 1, got {split_size}")
        length = len(self)
        sizes = [min(split_size, length - start) for start in range(0, length, split_size)]
        return self._split_sizes(sizes or [0])

    def _split_sizes(self, sizes: list[int]) -> list["DataProto"]:
        parts, start = [], 0
        for size in sizes:
            parts.append(self.slice(start, start + size))
            start += size
        return parts

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        """Rows of every part in order; ``meta_info`` merged by :func:`merge_meta_info`."""
        if not data:
            raise DataProtoError("concat needs at least one DataProto")
        with_batch = [part.batch is not None for part in data]
        if any(with_batch) and not all(with_batch):
            raise DataProtoError("concat: some parts have tensors and some do not")
        batch = None
        if all(with_batch):
            keys = set(data[0].tensor_keys())
            for position, part in enumerate(data[1:], start=1):
                if set(part.tensor_keys()) != keys:
                    raise DataProtoError(f"concat: part {position} has tensor keys {sorted(map(str, part.tensor_keys()))}, part 0 has {sorted(map(str, keys))}")
            batch = torch.cat([part.batch for part in data], dim=0)
        non_tensor = {}
        for key in data[0].non_tensor_batch:
            missing = [i for i, part in enumerate(data) if key not in part.non_tensor_batch]
            if missing:
                raise DataProtoError(f"concat: non_tensor_batch key {key!r} is missing from part(s) {missing}")
            non_tensor[key] = np.concatenate([part.non_tensor_batch[key] for part in data])
        return type(data[0])(batch, non_tensor, merge_meta_info([part.meta_info for part in data]))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Each row ``repeat_times`` times: ``interleave`` gives a a b b, otherwise a b a b."""
        if repeat_times < 1:
            raise DataProtoError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        length = len(self)
        if interleave:
            index = torch.arange(length).repeat_interleave(repeat_times)
        else:
            index = torch.arange(length).repeat(repeat_times)
        batch = None
        if self.batch is not None:
            if interleave:
                batch = self.batch.apply(lambda t: t.repeat_interleave(repeat_times, dim=0), batch_size=[length * repeat_times])
            else:
                batch = self.batch.apply(
                    lambda t: t.unsqueeze(0).expand(repeat_times, *t.shape).reshape(-1, *t.shape[1:]),
                    batch_size=[length * repeat_times],
                )
        numpy_index = index.numpy()
        non_tensor = {key: value[numpy_index] for key, value in self.non_tensor_batch.items()}
        return type(self)(batch, non_tensor, self.meta_info)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> "DataProto":
        """Row i ``repeat_times[i]`` times, in order (``[3, 1, 2]`` on a b c gives a a a b c c)."""
        counts = torch.as_tensor(np.asarray(repeat_times.cpu() if isinstance(repeat_times, torch.Tensor) else repeat_times))
        if counts.shape != (len(self),) or counts.is_floating_point() or (counts.numel() and counts.min() < 0):
            raise DataProtoError(
                f"sample_level_repeat: repeat_times must hold one non-negative int per row ({len(self)}), "
                f"got {counts.dtype} of shape {tuple(counts.shape)}"
            )
        return self.select_idxs(torch.arange(len(self)).repeat_interleave(counts.long()))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> "DataProto":
        """Cut each row of the ``split_keys`` columns along their second dimension into ``n_split``
        pieces that become consecutive rows; every other column repeats each row ``n_split`` times.

        A ``non_tensor_batch`` column of one list (or tuple) per row is split list-wise, each piece a
        row of its own; a 2-D array column along its second dimension.
        """
        split = set(split_keys or [])
        unknown = split - set(self.batch.keys() if self.batch is not None else []) - set(self.non_tensor_batch)
        if unknown:
            raise KeyError(f"unfold_column_chunks: split_keys {sorted(unknown)} are not columns of this DataProto")
        if n_split < 1:
            raise DataProtoError(f"unfold_column_chunks: n_split must be >= 1, got {n_split}")
        length = len(self) * n_split

        def pieces(key: str, value: Any) -> Any:
            if key not in split:
                return value.repeat_interleave(n_split, dim=0) if not isinstance(value, np.ndarray) else np.repeat(value, n_split, axis=0)
            if isinstance(value, np.ndarray) and value.ndim == 1:
                rows = []
                for row in value:
                    if not isinstance(row, (list, tuple)) or len(row) % n_split:
                        raise DataProtoError(f"unfold_column_chunks: a row of {key!r} is not a list that splits into {n_split}")
                    step = len(row) // n_split
                    rows.extend(row[piece * step : (piece + 1) * step] for piece in range(n_split))
                return as_object_array(rows)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(f"unfold_column_chunks: {key!r} of shape {tuple(value.shape)} does not split into {n_split} along dim 1")
            return value.reshape(length, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            columns = {key: pieces(key, value) for key, value in self.batch.items()}
            batch = TensorDict(columns, batch_size=[length], device=self.batch.device)
        non_tensor = {key: pieces(key, value) for key, value in self.non_tensor_batch.items()}
        return type(self)(batch, non_tensor, self.meta_info)

    def reorder(self, indices: Any) -> None:
        """Put the rows in the order of ``indices`` (a permutation) **in place** and return None:
        verl's meaning, and an exception to "operations return new objects". For a reordered new
        object use :meth:`select_idxs`."""
        index = to_index_tensor(indices, len(self))
        if not torch.equal(index.sort().values, torch.arange(len(self))):
            raise DataProtoError(
                f"reorder: indices must be a permutation of the {len(self)} rows; use select_idxs to pick rows"
            )
        reordered = self.select_idxs(index)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Append copies of the first rows (cycling) until the length divides by ``divisor``.

        Returns ``(padded, pad_size)``; ``padded.unpad(pad_size)`` gives back this DataProto's rows.
        This is the only padding mechanism: dispatch uses it too.
        """
        if divisor < 1:
            raise DataProtoError(f"pad_to_divisor: divisor must be >= 1, got {divisor}")
        length = len(self)
        pad_size = (-length) % divisor
        if pad_size == 0:
            return self, 0
        padding = self.select_idxs(torch.arange(pad_size) % length)
        return DataProto.concat([self, padding.select(meta_info_keys=[])]).with_meta_info(self.meta_info), pad_size

    def unpad(self, pad_size: int) -> "DataProto":
        """Drop the last ``pad_size`` rows that :meth:`pad_to_divisor` appended."""
        if pad_size < 0 or pad_size > len(self):
            raise DataProtoError(f"unpad: pad_size {pad_size} is not within 0..{len(self)}")
        return self if pad_size == 0 else self.slice(0, len(self) - pad_size)

    def with_meta_info(self, meta_info: Mapping[str, Any]) -> "DataProto":
        """The same rows with ``meta_info`` replaced."""
        return type(self)(self.batch, self.non_tensor_batch, meta_info)

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int = 1,
        seed: int | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        *,
        shuffle: bool | None = None,
    ) -> Iterator["DataProto"]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` passes, in row order unless shuffled.

        Shuffle with ``shuffle=True`` or, as in verl, ``dataloader_kwargs={"shuffle": True}`` (the only
        DataLoader argument that means something here); a ``seed`` alone does not shuffle, as in verl.
        Shuffled, each epoch uses its own permutation from a generator seeded with ``seed + epoch``,
        so the sequence is the same on every run and every rank. The length must divide by
        ``mini_batch_size``.
        """
        length = len(self)
        if mini_batch_size < 1 or length % mini_batch_size:
            raise DataProtoError(f"make_iterator: {length} rows do not split into mini-batches of {mini_batch_size}")
        options = dict(dataloader_kwargs or {})
        unsupported = sorted(set(options) - {"shuffle"})
        if unsupported:
            raise TypeError(f"make_iterator: dataloader_kwargs {unsupported} are not supported; only 'shuffle' is")
        if shuffle is None:
            shuffle = bool(options.get("shuffle", False))

        def iterate() -> Iterator[DataProto]:
            for epoch in range(epochs):
                if shuffle:
                    generator = torch.Generator().manual_seed((seed or 0) + epoch)
                    order = torch.randperm(length, generator=generator)
                else:
                    order = torch.arange(length)
                for start in range(0, length, mini_batch_size):
                    yield self.select_idxs(order[start : start + mini_batch_size])

        return iterate()

    def to(self, device: str | torch.device) -> "DataProto":
        """Tensors moved to ``device``: a new object (verl moves its receiver's and returns it; use the
        returned value)."""
        batch = self.batch.to(device) if self.batch is not None else None
        return type(self)(batch, self.non_tensor_batch, self.meta_info)

    # -- serialization -----------------------------------------------------------------------------------

    def _state(self, protocol: int) -> tuple:
        leaves = []
        if self.batch is not None:
            for key in self.batch.keys(include_nested=True, leaves_only=True):
                dtype_name, shape, raw = serialize_single_tensor(self.batch.get(key))
                buffer = pickle.PickleBuffer(raw) if protocol >= 5 else raw.tobytes()
                leaves.append((key, dtype_name, shape, buffer))
        length = len(self) if self.batch is not None else None
        return (FORMAT_VERSION, length, leaves, self.non_tensor_batch, self.meta_info)

    def __reduce_ex__(self, protocol: int):
        return (rebuild_data_proto, self._state(protocol))

    def __getstate__(self) -> tuple:
        """A self-contained state (tensors as bytes) for ``__setstate__``; pickling itself goes through
        ``__reduce_ex__``, which hands tensors over without copying."""
        return self._state(protocol=4)

    def __setstate__(self, state: tuple) -> None:
        restored = rebuild_data_proto(*state)
        self.batch, self.non_tensor_batch, self.meta_info = restored.batch, restored.non_tensor_batch, restored.meta_info

    def save_to_disk(self, path: str | Path) -> None:
        """Write to ``path`` (atomically: a temporary file renamed into place)."""
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        with open(temporary, "wb") as handle:
            pickle.dump(self, handle, protocol=5)
        temporary.replace(path)

    @staticmethod
    def load_from_disk(path: str | Path) -> "DataProto":
        """Read what :meth:`save_to_disk` wrote, admitting no type a batch does not hold."""
        with open(path, "rb") as handle:
            return BatchUnpickler(handle).load()


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """verl's name for ``data.pad_to_divisor(size_divisor)``: the one padding mechanism."""
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """verl's name for ``data.unpad(pad_size)``."""
    return data.unpad(pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group consecutive rows: ``[rows, ...]`` columns become ``[new_batch_size, rows // new_batch_size, ...]``
    (a new object; ``data`` is unchanged, where verl reshapes ``data``'s non-tensor arrays)."""
    length = len(data)
    if new_batch_size < 1 or length % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: {length} rows do not fold into {new_batch_size} groups")
    batch = None
    if data.batch is not None:
        batch = data.batch.apply(lambda t: t.reshape(new_batch_size, -1, *t.shape[1:]), batch_size=[new_batch_size])
    non_tensor = {key: value.reshape(new_batch_size, -1, *value.shape[1:]) for key, value in data.non_tensor_batch.items()}
    return type(data)(batch, non_tensor, data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """The inverse of :func:`fold_batch_dim`: the first ``batch_dims`` dimensions of every column become
    one batch dimension (a new object; ``data`` is unchanged)."""
    columns = [data.batch.get(key) for key in data.tensor_keys()] + list(data.non_tensor_batch.values())
    leading = {tuple(column.shape[:batch_dims]) for column in columns}
    if len(leading) > 1:
        raise DataProtoError(f"unfold_batch_dim: the columns' first {batch_dims} dimensions differ: {sorted(leading)}")
    length = math.prod(leading.pop()) if leading else 0
    batch = None
    if data.batch is not None:
        batch = data.batch.apply(lambda t: t.reshape(length, *t.shape[batch_dims:]), batch_size=[length])
    non_tensor = {key: value.reshape(length, *value.shape[batch_dims:]) for key, value in data.non_tensor_batch.items()}
    return type(data)(batch, non_tensor, data.meta_info)


def rebuild_data_proto(version: int, length: int | None, leaves: list, non_tensor_batch: dict, meta_info: dict) -> DataProto:
    """Inverse of ``DataProto.__reduce_ex__``: tensors are rebuilt over the received buffers, no copy."""
    if version != FORMAT_VERSION:
        raise DataProtoError(f"DataProto serialized with format {version}; this rlplat reads format {FORMAT_VERSION}")
    batch = None
    if length is not None:
        batch = TensorDict(batch_size=[length])
        for key, dtype_name, shape, buffer in leaves:
            batch.set(key, tensor_from_bytes(dtype_name, shape, buffer, copy=False))
    return DataProto(batch, non_tensor_batch, meta_info)


class BatchUnpickler(pickle.Unpickler):
    """Unpickles DataProtos from disk, refusing every global that a batch does not need."""

    ALLOWED = {
        ("rlplat.protocol", "rebuild_data_proto"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("collections", "OrderedDict"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("builtins", "range"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or (module.startswith("numpy") and name in np.sctypeDict and isinstance(np.sctypeDict[name], type)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from a DataProto file: only tensors, numpy arrays and plain "
            "Python values are allowed"
        )


def load_data_proto_bytes(data: bytes) -> DataProto:
    """Like :meth:`DataProto.load_from_disk` for bytes already in memory."""
    return BatchUnpickler(io.BytesIO(data)).load()
