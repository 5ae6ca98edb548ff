"""examples/rejection_sampling.py: rejection-sampling fine-tuning with the example's own loss, shipped
from its own module to 2 Ray workers, on a row count that changes every step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.slow  # starts a Ray cluster and trains: left out of `make test-fast`


@pytest.fixture
def fresh_ray():
    """No Ray in this process before the example starts its own (with the loss module shipped), none after."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture
def example(monkeypatch):
    # examples/ is on the driver's sys.path only: the workers can import the loss module only because
    # the example ships it (start_ray(py_modules=[...])); Ray adds just the driver's script folder
    # (the interpreter's, here) and working directory (the repository root) to theirs.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "rejection_sampling_loss", raising=False)
    spec = importlib.util.spec_from_file_location("rejection_sampling", EXAMPLES / "rejection_sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("rejection_sampling_loss", None)


def test_rejection_sampling_trains_the_kept_responses_with_its_own_loss_on_two_ray_workers(fresh_ray, example):
    # 16 prompts x 8 samples keep about 20 rows a step: mini-batches of 8 rows, then a remainder.
    history = example.main(steps=3, backend="ray", processes=2, prompts=16, samples=8, lr=3e-5, mini_batch_rows=8)
    assert len(history["nll_before"]) == 3, f"a step kept no response: accepted shares {history['accepted']}"
    for metrics in history["metrics"]:
        assert "actor/pg_loss" not in metrics  # not the algorithm's loss
        assert all(0.0 < value < 5.0 for value in metrics["rejection_sampling/nll"])  # the example's, from each rank
    # The update moved the weights towards the accepted answers: their likelihood rose in each step.
    for before, after in zip(history["nll_before"], history["nll_after"]):
        assert after < before
