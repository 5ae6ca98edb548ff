"""Fixtures of the megatron engine's tests: the project's tiny Qwen2 config and small batches."""

from __future__ import annotations

import os
import sys
from typing import Callable

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_testkit import TINY_QWEN2, make_batch  # noqa: E402


@pytest.fixture
def tiny_config() -> dict:
    """A fresh engine config (a plain dict) for the tiny model, lr 1e-3."""
    return dict(model_config=dict(TINY_QWEN2), seed=7, lr=1e-3, micro_batch_size_per_gpu=2)


@pytest.fixture
def batch_of() -> Callable[..., DataProto]:
    return make_batch
