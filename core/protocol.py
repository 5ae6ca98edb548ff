"""``DataProto``: the one batch container that moves between the driver and the workers.

Three parts: ``batch`` (a ``tensordict.TensorDict`` with one batch dimension), ``non_tensor_batch``
(str -> numpy array of the same length, usually ``dtype=object``) and ``meta_info`` (a dict that is
not split). Method names and semantics follow verl's ``DataProto`` so code ports over, with these
differences:

- Operations return new objects that share tensor storage; none modifies its receiver. The single
  exception is :meth:`DataProto.pop`, which, like ``dict.pop``, removes what it returns.
- There is one padding mechanism, :meth:`pad_to_divisor` / :meth:`unpad`; dispatch uses the same one.
- :meth:`union` returns a new object and raises on a key both sides hold with different values.
- :meth:`concat` merges ``meta_info`` by a documented rule (see :func:`merge_meta_info`).
- Pickling (protocol 5) hands every tensor and numeric numpy array over as an out-of-band buffer, so
  the Ray object store maps them instead of copying. A consequence: tensors of a DataProto that came
  out of ``ray.get`` are views of the shared object store; clone a tensor before changing it in place.
- :meth:`load_from_disk` never unpickles arbitrary code: tensors are raw bytes, and the unpickler
  only admits the numpy and builtin types a batch holds.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from tensordict import TensorDict

METRICS_KEY = "metrics"
FORMAT_VERSION = 1


def as_object_array(values: Any) -> np.ndarray:
    """A 1-D numpy object array of ``values`` (lists of lists stay one element per row)."""
    if isinstance(values, np.ndarray):
        return values
    values = list(values)
    array = np.empty(len(values), dtype=object)
    for row, value in enumerate(values):  # element-wise: equal-length lists must stay one object per row
        array[row] = value
    return array


def merge_meta_info(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The rule :meth:`DataProto.concat` uses for ``meta_info``.

    ``meta_info["metrics"]`` (a dict of name -> value or list of values) is gathered: the result maps
    each name to the list of every part's values, in order. Every other key must have equal values in
    all the parts that hold it (a key missing from some parts is taken from the others); unequal values
    raise a ``ValueError`` naming the key.
    """
    merged: dict[str, Any] = {}
    gathered: dict[str, list[Any]] = {}
    has_metrics = False
    for part in parts:
        for key, value in part.items():
            if key == METRICS_KEY:
                has_metrics = True
                for name, metric in dict(value).items():
                    gathered.setdefault(name, []).extend(metric if isinstance(metric, list) else [metric])
            elif key not in merged:
                merged[key] = value
            elif not values_equal(merged[key], value):
                raise ValueError(
                    f"cannot concat DataProto: meta_info[{key!r}] differs between parts "
                    f"({merged[key]!r:.60} vs {value!r:.60}); only meta_info['metrics'] is gathered"
                )
    if has_metrics:
        merged[METRICS_KEY] = gathered
    return merged


def values_equal(left: Any, right: Any) -> bool:
    if left is right:
        return True
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and torch.equal(left, right)
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        return np.array_equal(np.asarray(left, dtype=object), np.asarray(right, dtype=object))
    try:
        return bool(left == right)
    except Exception:
        return False


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
    ) -> "DataProto":
        """Build from ``tensors`` (all with the same first dimension) and ``non_tensors`` (sequences of
        that length, turned into numpy object arrays unless already numpy arrays)."""
        tensors = dict(tensors or {})
        non_tensor_batch = {key: as_object_array(value) for key, value in (non_tensors or {}).items()}
        batch = None
        if tensors:
            sizes = {key: value.shape[0] if value.dim() else None for key, value in tensors.items()}
            first = next(iter(sizes.values()))
            if any(size != first for size in sizes.values()) or first is None:
                raise ValueError(f"every tensor needs the same first (batch) dimension; got {sizes}")
            batch = TensorDict(tensors, batch_size=[first])
        return cls(batch, non_tensor_batch, meta_info)

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None) -> "DataProto":
        """Build from one dict: tensors go to ``batch``, numpy arrays and lists to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        for key, value in others.items():
            if not isinstance(value, (np.ndarray, list, tuple)):
                raise TypeError(f"from_single_dict: {key!r} is a {type(value).__name__}, not a tensor, array or list")
        return cls.from_dict(tensors, others, meta_info)

    def check_consistency(self) -> None:
        """Raise ``ValueError`` (naming the key) unless every column has the same number of rows."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"DataProto.batch must have exactly one batch dimension, got {self.batch.batch_size}")
        length = self.batch.batch_size[0] if self.batch is not None else None
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value).__name__}")
            if length is None:
                length = len(value)
            elif len(value) != length:
                raise ValueError(f"non_tensor_batch[{key!r}] has {len(value)} rows, the batch has {length}")

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
        return DataProto(batch, non_tensor, self.meta_info)

    def select_idxs(self, idxs: Any) -> "DataProto":
        """Rows at ``idxs`` (ints, in that order, repeats allowed) or where a boolean mask is True."""
        index = to_index_tensor(idxs, len(self))
        batch = self.batch[index] if self.batch is not None else None
        numpy_index = index.numpy()
        non_tensor = {key: value[numpy_index] for key, value in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensor, self.meta_info)

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> "DataProto":
        """A DataProto with only these keys (None keeps all of that part); ``deepcopy`` copies data."""
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
        return DataProto(batch, non_tensor, meta)

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
        """Remove these keys from this DataProto and return them as a new one (the one method that
        modifies its receiver, like ``dict.pop``)."""
        popped = self.select(batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or [])
        if self.batch is not None and batch_keys:
            self.batch = self.batch.exclude(*batch_keys)
        for key in non_tensor_batch_keys or []:
            del self.non_tensor_batch[key]
        for key in meta_info_keys or []:
            del self.meta_info[key]
        return popped

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> "DataProto":
        """A DataProto whose batch keys ``old_keys`` are called ``new_keys``."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys but {len(new)} new keys")
        if self.batch is None:
            raise KeyError(f"rename: no tensors to rename ({old})")
        self._require(old, self.batch.keys(), "batch")
        batch = self.batch.clone(recurse=False)
        for source, target in zip(old, new):
            batch.rename_key_(source, target)
        return DataProto(batch, self.non_tensor_batch, self.meta_info)

    def union(self, other: "DataProto") -> "DataProto":
        """All keys of both. A key both hold must have equal values (else ``ValueError`` naming it);
        meta_info follows the same rule."""
        if len(self) != len(other) and (self.batch is not None or self.non_tensor_batch) and (
            other.batch is not None or other.non_tensor_batch
        ):
            raise ValueError(f"union of DataProtos with {len(self)} and {len(other)} rows")
        batch = self.batch
        if other.batch is not None:
            if batch is None:
                batch = other.batch
            else:
                present = set(batch.keys(include_nested=True, leaves_only=True))
                added = {}
                for key in other.batch.keys(include_nested=True, leaves_only=True):
                    value = other.batch.get(key)
                    if key not in present:
                        added[key] = value
                    elif not torch.equal(batch.get(key), value):
                        raise ValueError(f"union: batch key {key!r} is in both DataProtos with different values")
                if added:
                    batch = batch.clone(recurse=False)
                    batch.update(added)
        non_tensor = dict(self.non_tensor_batch)
        for key, value in other.non_tensor_batch.items():
            if key in non_tensor:
                if not values_equal(non_tensor[key], value):
                    raise ValueError(f"union: non_tensor_batch key {key!r} is in both DataProtos with different values")
                continue
            non_tensor[key] = value
        meta = dict(self.meta_info)
        for key, value in other.meta_info.items():
            if key in meta and not values_equal(meta[key], value):
                raise ValueError(f"union: meta_info key {key!r} is in both DataProtos with different values")
            meta[key] = value
        return DataProto(batch, non_tensor, meta)

    # -- splitting and joining ---------------------------------------------------------------------------

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Exactly ``chunks`` parts of near-equal size (the first ``len % chunks`` one row longer)."""
        if chunks < 1:
            raise ValueError(f"chunk: chunks must be >= 1, got {chunks}")
        base, extra = divmod(len(self), chunks)
        sizes = [base + (1 if i < extra else 0) for i in range(chunks)]
        return self._split_sizes(sizes)

    def split(self, split_size: int) -> list["DataProto"]:
        """Parts of ``split_size`` rows (the last may be shorter)."""
        if split_size < 1:
            raise ValueError(f"split: split_size must be >= 1, got {split_size}")
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
            raise ValueError("concat needs at least one DataProto")
        with_batch = [part.batch is not None for part in data]
        if any(with_batch) and not all(with_batch):
            raise ValueError("concat: some parts have tensors and some do not")
        batch = None
        if all(with_batch):
            keys = set(data[0].tensor_keys())
            for position, part in enumerate(data[1:], start=1):
                if set(part.tensor_keys()) != keys:
                    raise ValueError(f"concat: part {position} has tensor keys {sorted(map(str, part.tensor_keys()))}, part 0 has {sorted(map(str, keys))}")
            batch = torch.cat([part.batch for part in data], dim=0)
        non_tensor = {}
        for key in data[0].non_tensor_batch:
            missing = [i for i, part in enumerate(data) if key not in part.non_tensor_batch]
            if missing:
                raise ValueError(f"concat: non_tensor_batch key {key!r} is missing from part(s) {missing}")
            non_tensor[key] = np.concatenate([part.non_tensor_batch[key] for part in data])
        return DataProto(batch, non_tensor, merge_meta_info([part.meta_info for part in data]))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Each row ``repeat_times`` times: ``interleave`` gives a a b b, otherwise a b a b."""
        if repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
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
        return DataProto(batch, non_tensor, self.meta_info)

    def reorder(self, indices: Any) -> "DataProto":
        """Rows in the order of ``indices`` (a permutation); a new object, unlike verl's in-place reorder."""
        return self.select_idxs(indices)

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Append copies of the first rows (cycling) until the length divides by ``divisor``.

        Returns ``(padded, pad_size)``; ``padded.unpad(pad_size)`` gives back this DataProto's rows.
        This is the only padding mechanism: dispatch uses it too.
        """
        if divisor < 1:
            raise ValueError(f"pad_to_divisor: divisor must be >= 1, got {divisor}")
        length = len(self)
        pad_size = (-length) % divisor
        if pad_size == 0:
            return self, 0
        padding = self.select_idxs(torch.arange(pad_size) % length)
        return DataProto.concat([self, padding.select(meta_info_keys=[])]).with_meta_info(self.meta_info), pad_size

    def unpad(self, pad_size: int) -> "DataProto":
        """Drop the last ``pad_size`` rows that :meth:`pad_to_divisor` appended."""
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"unpad: pad_size {pad_size} is not within 0..{len(self)}")
        return self if pad_size == 0 else self.slice(0, len(self) - pad_size)

    def with_meta_info(self, meta_info: Mapping[str, Any]) -> "DataProto":
        """The same rows with ``meta_info`` replaced."""
        return DataProto(self.batch, self.non_tensor_batch, meta_info)

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, seed: int | None = None, shuffle: bool | None = None
    ) -> Iterator["DataProto"]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` passes.

        With a ``seed`` (or ``shuffle=True``) each epoch uses its own permutation drawn from a generator
        seeded with ``seed + epoch``, so the sequence is the same on every run and every rank. The
        length must divide by ``mini_batch_size``.
        """
        length = len(self)
        if mini_batch_size < 1 or length % mini_batch_size:
            raise ValueError(f"make_iterator: {length} rows do not split into mini-batches of {mini_batch_size}")
        shuffle = seed is not None if shuffle is None else shuffle

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
        """Tensors moved to ``device`` (a new object)."""
        batch = self.batch.to(device) if self.batch is not None else None
        return DataProto(batch, self.non_tensor_batch, self.meta_info)

    # -- serialization -----------------------------------------------------------------------------------

    def __reduce_ex__(self, protocol: int):
        leaves = []
        if self.batch is not None:
            for key in self.batch.keys(include_nested=True, leaves_only=True):
                tensor = self.batch.get(key).detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                tensor = tensor.contiguous()
                raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.zeros(0, np.uint8)
                buffer = pickle.PickleBuffer(raw) if protocol >= 5 else raw.tobytes()
                leaves.append((key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), buffer))
        length = len(self) if self.batch is not None else None
        return (rebuild_data_proto, (FORMAT_VERSION, length, leaves, self.non_tensor_batch, self.meta_info))

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


def rebuild_data_proto(version: int, length: int | None, leaves: list, non_tensor_batch: dict, meta_info: dict) -> DataProto:
    """Inverse of ``DataProto.__reduce_ex__``: tensors are rebuilt over the received buffers, no copy."""
    if version != FORMAT_VERSION:
        raise ValueError(f"DataProto serialized with format {version}; this rlplat reads format {FORMAT_VERSION}")
    batch = None
    if length is not None:
        tensors = {}
        for key, dtype_name, shape, buffer in leaves:
            dtype = getattr(torch, dtype_name)
            if math.prod(shape) == 0:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                with warnings.catch_warnings():
                    # Buffers from the object store are read-only; the tensors are views of them.
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
            tensors[key] = tensor
        batch = TensorDict(batch_size=[length])
        for key, tensor in tensors.items():
            batch.set(key, tensor)
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
