"""Weight fingerprints: how a worker checks, after a weight sync, that its rollout holds what the actor sent.

A :class:`~rlplat.contracts.rollout.Fingerprint` of a tensor is its dtype, element count, and the float64 sum, sum of absolute values
and sum of squares of its elements: one pass, a few numbers per tensor. The worker fingerprints each tensor
as it sends it and compares with :meth:`RolloutEngine.weight_fingerprints` (what the rollout holds) once the
sync is done; a rollout that does not implement it is not checked. The same values in the same dtype give
the same sums bit for bit (CPU and GPU reductions are deterministic for a fixed shape); a rollout that holds
another dtype (bf16 from an fp32 actor) rounds each element by at most its unit roundoff, which
:func:`tolerance` allows. A corrupted, stale or skipped tensor differs by far more, unless the change is
below that rounding (an update of 1e-7 relative to the weights is invisible to a bf16 rollout; the policy
version check catches a skipped sync regardless).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlplat.contracts.rollout import Fingerprint  # noqa: F401 (the contract's type; importable here too)

#: Unit roundoff of each floating dtype (half the distance between 1 and the next number).
UNIT_ROUNDOFF = {"torch.float64": 2.0 ** -53, "torch.float32": 2.0 ** -24, "torch.bfloat16": 2.0 ** -8,
                 "torch.float16": 2.0 ** -11}


CHUNK_ELEMENTS = 1 << 22
"""Elements read into float64 at a time (32 MiB): a vocabulary-sized embedding is never copied whole."""


def fingerprint(tensor: Any) -> Fingerprint:
    """The :class:`Fingerprint` of ``tensor`` (any device; read once, in float64 chunks of
    :data:`CHUNK_ELEMENTS`, summed in a fixed order)."""
    import torch

    flat = tensor.detach().reshape(-1)
    sums = None
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        values = flat[start:start + CHUNK_ELEMENTS].double()
        chunk = torch.stack([values.sum(), values.abs().sum(), torch.dot(values, values)])
        sums = chunk if sums is None else sums + chunk
    total, absolute, squares = sums.tolist() if sums is not None else (0.0, 0.0, 0.0)  # one device sync per tensor
    return Fingerprint(str(tensor.dtype), int(flat.numel()), total, absolute, squares)


def tolerance(sent_dtype: str, held_dtype: str) -> float:
    """The relative difference rounding between the two dtypes can make: 0 up to float64 summation for
    equal dtypes, twice the coarser dtype's unit roundoff otherwise (4x on squares, see :func:`differs`)."""
    if sent_dtype == held_dtype:
        return 1e-12
    return 2.0 * max(UNIT_ROUNDOFF.get(sent_dtype, 2.0 ** -8), UNIT_ROUNDOFF.get(held_dtype, 2.0 ** -8))


def differs(sent: Fingerprint, held: Fingerprint) -> str | None:
    """Why ``held`` is not a (rounded) copy of ``sent``, or None when it is."""
    if sent.numel != held.numel:
        return f"{held.numel} elements held, {sent.numel} sent"
    tol = tolerance(sent.dtype, held.dtype)
    scale = max(sent.absolute, held.absolute, 1e-30)
    for name, left, right, bound in (("sum", sent.total, held.total, tol * scale),
                                     ("sum of |x|", sent.absolute, held.absolute, tol * scale),
                                     ("sum of squares", sent.squares, held.squares, 2 * tol * max(sent.squares, held.squares, 1e-30))):
        if not abs(left - right) <= bound:  # NaN never passes
            return f"{name} {right:.9g} held, {left:.9g} sent (allowed difference {bound:.3g})"
    return None


def compare(sent: Mapping[str, Fingerprint], held: Mapping[str, Fingerprint]) -> tuple[int, dict[str, str]]:
    """``(tensors compared, {name: why it differs})`` over the names both sides have."""
    names = [name for name in sent if name in held]
    problems = {name: why for name in names if (why := differs(sent[name], held[name])) is not None}
    return len(names), problems


@dataclasses.dataclass
class PackedBucket:
    """A bucket of ``(name, tensor)`` pairs as one flat byte array (:func:`pack_bucket`): what crosses Ray's
    object store between an actor and a rollout in another worker group. Ray stores a numpy array with one copy
    and hands the receiver a read-only view of shared memory, where a list of tensors is pickled tensor by tensor
    and copied again on each side (3x slower at 20-200 MiB: ``bench/scaling.py``)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]  # each tensor's first byte in ``data``, a multiple of PACK_ALIGNMENT
    data: Any  # numpy uint8 [total bytes]


PACK_ALIGNMENT = 16
"""Byte alignment of every tensor in a packed bucket (a view of a dtype needs its offset divisible by its size)."""


def pack_bucket(bucket: Any) -> PackedBucket:
    """``bucket`` (``(name, tensor)`` pairs, any device and dtype) as a :class:`PackedBucket` in CPU memory."""
    import torch

    pairs = list(bucket)
    parts, offsets, size = [], [], 0
    for _, tensor in pairs:
        offsets.append(size)
        part = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
        padding = -part.numel() % PACK_ALIGNMENT
        parts += [part, torch.zeros(padding, dtype=torch.uint8)] if padding else [part]
        size += part.numel() + padding
    data = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return PackedBucket([name for name, _ in pairs], [str(tensor.dtype) for _, tensor in pairs],
                        [tuple(tensor.shape) for _, tensor in pairs], offsets, data.numpy())


def unpack_bucket(packed: PackedBucket | Any) -> list:
    """The ``(name, tensor)`` pairs of a :class:`PackedBucket` as CPU views of its bytes (read them, do not
    write: a bucket fetched from Ray's object store is read-only shared memory); anything else unchanged."""
    if not isinstance(packed, PackedBucket):
        return packed
    import warnings

    import torch

    with warnings.catch_warnings():  # torch warns that the array is not writable: the views are only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(packed.data)
    pairs = []
    for name, dtype, shape, offset in zip(packed.names, packed.dtypes, packed.shapes, packed.offsets):
        kind = getattr(torch, dtype.removeprefix("torch."))
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=kind).element_size()
        pairs.append((name, data[offset : offset + nbytes].view(kind).view(shape)))
    return pairs
