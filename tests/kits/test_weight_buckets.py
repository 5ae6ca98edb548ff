"""Weight buckets packed into one byte array for Ray's object store (``rlplat.kits.weights``): every dtype and shape
comes back bit for bit, through a real object store round trip too."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlplat.kits.weights import PackedBucket, pack_bucket, unpack_bucket


def bucket() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=generator)),
        ("model.norm.weight", torch.randn(8, generator=generator).to(torch.bfloat16)),
        ("lm_head.bias", torch.randn(3, generator=generator).half()),
        ("counter", torch.tensor(7, dtype=torch.int64)),  # a 0-d buffer
        ("empty", torch.zeros(0, 4)),
        ("transposed", torch.randn(4, 6, generator=generator).t()),  # not contiguous
    ]


def assert_same(left, right) -> None:
    assert [name for name, _ in left] == [name for name, _ in right]
    for (name, a), (_, b) in zip(left, right):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def test_a_packed_bucket_unpacks_to_the_same_names_dtypes_shapes_and_bits():
    packed = pack_bucket(bucket())
    assert isinstance(packed, PackedBucket) and packed.data.dtype.name == "uint8"
    assert sum(t.numel() * t.element_size() for _, t in bucket()) <= packed.data.nbytes < 16 * len(bucket()) + sum(
        t.numel() * t.element_size() for _, t in bucket())
    assert_same(unpack_bucket(pickle.loads(pickle.dumps(packed))), bucket())


def test_unpack_passes_anything_else_through_and_an_empty_bucket_packs():
    plain = bucket()
    assert unpack_bucket(plain) is plain
    assert unpack_bucket(pack_bucket([])) == []


@pytest.mark.slow
def test_a_bucket_through_rays_object_store_comes_back_bit_for_bit():
    import ray

    from rlplat.controller.ray_backend import start_ray

    started = not ray.is_initialized()
    if started:
        start_ray(num_cpus=1)
    try:
        @ray.remote(num_cpus=0)
        def receive(packed):  # the receiver gets a read-only view of the object store's memory
            return [(name, tensor.clone()) for name, tensor in unpack_bucket(packed)]

        assert_same(ray.get(receive.remote(ray.put(pack_bucket(bucket())))), bucket())
    finally:
        if started:
            ray.shutdown()
