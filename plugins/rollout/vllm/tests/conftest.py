"""Without a GPU, vLLM cannot infer its platform and refuses to build its config classes; the API
compatibility tests only parse arguments and build configs, so they run under vLLM's CPU platform."""

import importlib.util
import os

import torch

if importlib.util.find_spec("vllm") is not None and not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


# The real-engine test files (test_cpu_engine.py, test_gpu.py) share these: a tiny Qwen2 saved once per
# module, and a rollout per mode built with the module's own SETTINGS (dtype, memory keys).
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlplat.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


def built_engine(request, model_dir, mode: str):
    from rlplat_rollout_vllm.rollout import VLLMRollout

    engine = VLLMRollout({"model_path": model_dir, "mode": mode, **request.module.SETTINGS})
    request.addfinalizer(engine.close)
    return engine


@pytest.fixture(scope="module")
def hybrid_engine(request, model_dir):
    return built_engine(request, model_dir, "hybrid")


@pytest.fixture(scope="module")
def server_engine(request, model_dir):
    return built_engine(request, model_dir, "server")
