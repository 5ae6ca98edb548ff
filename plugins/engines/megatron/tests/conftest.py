"""Fixtures of the megatron engine's tests: the project's tiny Qwen2 config and small batches (:mod:`rlplat.testing.engines`)."""

from __future__ import annotations

import os
import sys
from typing import Callable

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rlplat import DataProto  # noqa: E402
from rlplat.testing.engines import TINY_QWEN2, tiny_engine_batch  # noqa: E402


@pytest.fixture(scope="session")
def two_process_results(tmp_path_factory) -> dict:
    """Rank 0's results of the one two-process launch of numerics_worker.py the numerics and memory tests
    share: ``memory`` (every rank's measured peaks), then the numerics layouts' log-probs, weights, ...;
    the processes have exited when it returns."""
    from two_process_launch import launch_two_processes

    return launch_two_processes(tmp_path_factory.mktemp("megatron-two-processes"))


@pytest.fixture
def tiny_config() -> dict:
    """A fresh engine config (a plain dict) for the tiny model, lr 1e-3."""
    return dict(model_config=dict(TINY_QWEN2), seed=7, lr=1e-3, micro_batch_size_per_gpu=2)


@pytest.fixture
def batch_of() -> Callable[..., DataProto]:
    return tiny_engine_batch


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_by_the_module():
    """The loop test's run on ``cluster.backend=ray`` starts a local Ray cluster in this process; it is stopped
    when the module ends, so that it does not keep running under the next modules' multi-process launches."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
