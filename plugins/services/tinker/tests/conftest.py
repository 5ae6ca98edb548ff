"""Fixtures of rlplat-tinker's tests: a tiny model folder and a running service on loopback."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's telemetry posts go nowhere in tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from rlplat.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tinker") / "model", seed=3)


@pytest.fixture(scope="module")
def running(model_dir, tmp_path_factory):
    from rlplat_tinker.serve import start

    with start(model_dir, state_dir=str(tmp_path_factory.mktemp("states"))) as service:
        yield service


@pytest.fixture(scope="module")
def service_client(running):
    import tinker

    with tinker.ServiceClient(base_url=running.base_url, api_key="tml-test") as client:  # closing stops its heartbeats
        yield client
