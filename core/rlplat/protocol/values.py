"""Values of a :class:`~rlplat.protocol.DataProto` batch: the error type, object arrays, how ``meta_info``
of several batches merges, equality that counts NaN in the same place as equal, and verl's dict unions."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

METRICS_KEY = "metrics"
HEALTH_EVENTS_KEY = "health_events"


class DataProtoError(ValueError, AssertionError):
    """Data that does not fit together: rows of different lengths, a key both sides of a union hold
    with different values, conflicting ``meta_info``. A ``ValueError``; also an ``AssertionError``
    because verl raises that for the same conditions, so code written for verl still catches it."""


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

    ``meta_info["metrics"]`` is gathered, and ``meta_info["health_events"]`` (lists of a run's health
    events, :mod:`rlplat.contracts.health`) are joined in part order. Each ``metrics`` part's value is a dict of name -> value (or list of
    values), a list of such dicts (what verl's agent loop and workers produce), or None. The result
    maps each name to the list of all the values in part order, lists flattened:
    ``[{"loss": 0.5}]`` and ``{"loss": [0.6, 0.7]}`` give ``{"loss": [0.5, 0.6, 0.7]}``. Every other
    key must have equal values in all the parts that hold it (a key missing from some parts is taken
    from the others); unequal values raise a :class:`DataProtoError` naming the key.
    """
    merged: dict[str, Any] = {}
    gathered: dict[str, list[Any]] = {}
    has_metrics = False
    for position, part in enumerate(parts):
        for key, value in part.items():
            if key == METRICS_KEY:
                if value is None:
                    continue
                has_metrics = True
                for metrics in value if isinstance(value, (list, tuple)) else [value]:
                    if not isinstance(metrics, Mapping):
                        raise DataProtoError(
                            f"cannot concat DataProto: part {position}'s meta_info['metrics'] holds a "
                            f"{type(metrics).__name__}; expected a dict of name -> value, or a list of such dicts"
                        )
                    for name, metric in metrics.items():
                        gathered.setdefault(name, []).extend(metric if isinstance(metric, list) else [metric])
            elif key == HEALTH_EVENTS_KEY:
                merged[key] = [*merged.get(key, ()), *(value or ())]
            elif key not in merged:
                merged[key] = value
            elif not values_equal(merged[key], value):
                raise DataProtoError(
                    f"cannot concat DataProto: Conflicting values for meta_info key {key!r} "
                    f"({merged[key]!r:.60} vs {value!r:.60} in part {position}); only meta_info['metrics'] "
                    "and ['health_events'] are gathered, every other key must be equal in all parts"
                )
    if has_metrics:
        merged[METRICS_KEY] = gathered
    return merged


def tensors_equal(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Same shape and values, NaN in the same place counting as equal."""
    if left is right:
        return True
    if left.shape != right.shape:
        return False
    if torch.equal(left, right):
        return True
    if not (left.is_floating_point() or left.is_complex()):
        return False
    return bool(((left == right) | (left.isnan() & right.isnan())).all())


def is_nan(value: Any) -> bool:
    return isinstance(value, (float, np.floating)) and math.isnan(value)


def values_equal(left: Any, right: Any, _path: set[tuple[int, int]] | None = None) -> bool:
    """Deep equality of batch values (verl's ``_deep_equal`` rule, extended to containers).

    NaN equals NaN in the same place; numpy arrays must agree in dtype and shape, object arrays,
    lists, tuples and dicts are compared element by element; tensors by :func:`tensors_equal`;
    numbers by value (``1 == 1.0``), everything else only with a value of the same type. A structure
    that refers back to itself compares equal to one that does so at the same place.
    """
    if left is right:
        return True
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and tensors_equal(left, right)
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        if not (isinstance(left, np.ndarray) and isinstance(right, np.ndarray)):
            return False
        if left.dtype != right.dtype or left.shape != right.shape:
            return False
        if left.dtype != object:
            return bool(np.array_equal(left, right, equal_nan=left.dtype.kind in "fc"))
        pairs: Any = zip(left.flat, right.flat)
    elif isinstance(left, Mapping) and isinstance(right, Mapping):
        if type(left) is not type(right) or left.keys() != right.keys():
            return False
        pairs = ((left[key], right[key]) for key in left)
    elif isinstance(left, (list, tuple)) and type(left) is type(right):
        if len(left) != len(right):
            return False
        pairs = zip(left, right)
    else:
        if is_nan(left) and is_nan(right):
            return True
        if type(left) is not type(right) and not (isinstance(left, numbers.Number) and isinstance(right, numbers.Number)):
            return False
        try:
            return bool(left == right)
        except Exception:
            return False
    path = set() if _path is None else _path
    pair = (id(left), id(right))
    if pair in path:
        return True
    path.add(pair)
    try:
        return all(values_equal(a, b, path) for a, b in pairs)
    finally:
        path.discard(pair)


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s columns to ``tensor_dict1`` **in place** and return ``tensor_dict1``
    (verl's meaning). A column both hold must be equal (:func:`tensors_equal`), else
    :class:`DataProtoError`. :meth:`DataProto.union` uses it on a shallow copy of its receiver's batch."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union: the two batches have batch sizes {list(tensor_dict1.batch_size)} and {list(tensor_dict2.batch_size)}"
        )
    present = set(tensor_dict1.keys(include_nested=True, leaves_only=True))
    added = {}
    for key in tensor_dict2.keys(include_nested=True, leaves_only=True):
        value = tensor_dict2.get(key)
        if key not in present:
            added[key] = value
        elif not tensors_equal(tensor_dict1.get(key), value):
            raise DataProtoError(f"union: batch key {key!r} is in both with different values")
    if added:
        tensor_dict1.update(added)
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to the dict ``tensor_dict1`` **in place** and return it (verl's
    meaning). An array both hold must be equal by :func:`values_equal` (NaN in the same place, arrays
    per row), else :class:`DataProtoError`."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            for side, array in (("tensor_dict1", tensor_dict1[key]), ("tensor_dict2", value)):
                if not isinstance(array, np.ndarray):
                    raise TypeError(f"union_numpy_dict: {side}[{key!r}] is a {type(array).__name__}, not a numpy array")
            if not values_equal(tensor_dict1[key], value):
                raise DataProtoError(
                    f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object. A key both dicts hold "
                    "must have equal values (NaN equals NaN in the same place)"
                )
        tensor_dict1[key] = value
    return tensor_dict1


