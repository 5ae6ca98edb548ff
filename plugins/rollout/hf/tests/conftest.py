"""Fixtures of the hf rollout's tests: a tiny Qwen2 saved locally and an engine over it."""

from __future__ import annotations

import pytest

from rlplat.testing.tiny_models import save_tiny_model
from rlplat_rollout_hf.rollout import HFRollout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture
def engine(model_dir):
    return HFRollout({"model_path": model_dir})
