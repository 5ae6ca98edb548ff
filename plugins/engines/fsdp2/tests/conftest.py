"""Fixtures of the fsdp2 engine's tests: the project's tiny Qwen2 config and small batches (:mod:`rlplat.testing.engines`),
a local Ray cluster."""

from __future__ import annotations

import os
from typing import Callable

import pytest

from rlplat import DataProto
from rlplat.testing.engines import TINY_QWEN2, tiny_engine_batch


@pytest.fixture
def tiny_config() -> dict:
    """A fresh engine config (a plain dict) for the tiny model, float32, lr 1e-3."""
    return dict(model_config=dict(TINY_QWEN2), seed=7, lr=1e-3, micro_batch_size_per_gpu=2, dtype="float32")


@pytest.fixture
def batch_of() -> Callable[..., DataProto]:
    """``batch_of(rows=8, seed=0)``: see :func:`rlplat.testing.engines.tiny_engine_batch`."""
    return tiny_engine_batch


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (4 CPUs: two worker processes and room to spare)."""
    import ray

    from rlplat import start_ray

    if ray.is_initialized():
        ray.shutdown()
    # A cluster of our own: without this, ray.init joins one that `ray start` or other tests announced.
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "local"
    try:
        start_ray(num_cpus=4)
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS")
        else:
            os.environ["RAY_ADDRESS"] = previous
    yield ray
    ray.shutdown()
