"""examples/custom_pipeline.py: a hand-written GRPO loop from the public names runs on the demo."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_pipeline.py"


def test_the_custom_pipeline_trains_a_few_steps_on_two_ray_workers(local_ray):
    spec = importlib.util.spec_from_file_location("custom_pipeline", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.main(steps=3, backend="ray", processes=2)
    assert len(history["score"]) == 3 and all(math.isfinite(score) for score in history["score"])
    assert max(history["log_prob_diff"]) < 1e-4
    assert len(history["val_acc"]) == 2 and all(0.0 <= acc <= 1.0 for acc in history["val_acc"])
