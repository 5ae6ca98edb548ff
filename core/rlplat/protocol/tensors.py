"""Tensors as bytes (verl's serialized format: dtype name, shape, raw bytes; no pickled code), for
:class:`~rlplat.protocol.DataProto`'s pickling and files."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlplat.protocol.values import DataProtoError


def serialize_single_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, bytes as a uint8 numpy array)`` of a tensor, moved to the CPU (verl's format;
    no pickled code). The array is a view of the tensor's memory when it is already contiguous on the CPU."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.zeros(0, np.uint8)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw


def tensor_from_bytes(dtype_name: str, shape: Sequence[int], buffer: Any, copy: bool) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise DataProtoError(f"serialized tensor names dtype {dtype_name!r}, which is not a torch dtype")
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if copy:
        buffer = bytearray(buffer)
    with warnings.catch_warnings():
        # Buffers from the object store are read-only; the tensors are views of them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def deserialize_single_tensor(serialized: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    """The tensor :func:`serialize_single_tensor` described, in memory of its own (a copy)."""
    dtype_name, shape, data = serialized
    return tensor_from_bytes(dtype_name, shape, data, copy=True)


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[Any, tuple]]:
    """``(batch size, device, {key: serialized tensor})`` of a TensorDict (verl's format): each leaf by
    :func:`serialize_single_tensor`, a nested tensor as ``(layout name, [its tensors])``; nested
    TensorDicts under tuple keys."""
    encoded: dict[Any, tuple] = {}
    for key in batch.keys(include_nested=True, leaves_only=True):
        value = batch.get(key)
        if value.is_nested:
            encoded[key] = (str(value.layout).removeprefix("torch."), [serialize_single_tensor(t) for t in value.unbind()])
        else:
            encoded[key] = serialize_single_tensor(value)
    return tuple(batch.batch_size), (str(batch.device) if batch.device is not None else None), encoded


def deserialize_tensordict(serialized: tuple[Sequence[int], str | None, Mapping[Any, tuple]]) -> TensorDict:
    """The TensorDict :func:`serialize_tensordict` described (tensors copied into memory of their own)."""
    batch_size, device, encoded = serialized
    batch = TensorDict(batch_size=list(batch_size), device=device)
    for key, value in encoded.items():
        if len(value) == 3:
            batch.set(key, deserialize_single_tensor(value))
        elif len(value) == 2:
            layout_name, parts = value
            layout = getattr(torch, layout_name, None)
            if not isinstance(layout, torch.layout):
                raise DataProtoError(f"serialized nested tensor {key!r} names layout {layout_name!r}, which is not a torch layout")
            batch.set(key, torch.nested.as_nested_tensor([deserialize_single_tensor(part) for part in parts], layout=layout))
        else:
            raise DataProtoError(f"serialized tensor {key!r} has {len(value)} fields; expected 3 (a tensor) or 2 (a nested tensor)")
    return batch
