"""SGLang reads ``SGLANG_USE_CPU_ENGINE`` once, when its modules are imported: where the installed SGLang runs on
CPUs (the ``.venv-sglang-cpu`` environment of ``make test``), it is set before any test module imports sglang, as
the rollout sets it before it builds an engine.

The real-engine test files share these fixtures: a tiny Qwen2 saved once per module, and a rollout per mode
built with the module's own ``SETTINGS``."""

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is not None:
    from rlplat_rollout_sglang.platform import use_cpu_engine

    use_cpu_engine()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlplat.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


def built_engine(request, model_dir, mode: str):
    from rlplat_rollout_sglang.rollout import SGLangRollout

    engine = SGLangRollout({"model_path": model_dir, "mode": mode, **request.module.SETTINGS})
    request.addfinalizer(engine.close)
    return engine


@pytest.fixture(scope="module")
def hybrid_engine(request, model_dir):
    return built_engine(request, model_dir, "hybrid")


@pytest.fixture(scope="module")
def server_engine(request, model_dir):
    return built_engine(request, model_dir, "server")
