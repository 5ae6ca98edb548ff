"""rlplat: reinforcement-learning post-training of language models.

The public names are resolved lazily (PEP 562) so that ``import rlplat`` and plugin discovery import
no torch, Ray or tensordict; each name imports its module on first access. ``PLUGIN_API_VERSION`` (the
plugin API this rlplat provides, :mod:`rlplat.api_version`) is a plain constant.
"""

from __future__ import annotations

from typing import Any

from rlplat import deprecation as _deprecation
from rlplat.api_version import PLUGIN_API_VERSION
from rlplat.lazy_names import lazy_names

_deprecation.install_moved_modules()  # old names of modules that moved (rlplat.deprecation.MOVED_MODULES)

__all__ = [
    "Algorithm",
    "DataProto",
    "Dispatch",
    "Execute",
    "PLUGIN_API_VERSION",
    "LocalWorkerGroup",
    "RayWorkerGroup",
    "ResourcePool",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerSpec",
    "register",
    "start_ray",
    "EngineRegistry",
    "RewardManager",
    "RolloutEngine",
    "Trainer",
    "TrainingEngine",
    "__version__",
    "hookimpl",
    "load_config",
    "read_config_node",
    "ConfigError",
    "registry",
]

# public name -> (module, attribute); attribute None means the module itself.
_LAZY_NAMES: dict[str, tuple[str, str | None]] = {
    "registry": ("rlplat.registry", None),
    "DataProto": ("rlplat.protocol", "DataProto"),
    "Worker": ("rlplat.controller.worker", "Worker"),
    "WorkerGroup": ("rlplat.controller.worker_group", "WorkerGroup"),
    "WorkerError": ("rlplat.controller.worker_group", "WorkerError"),
    "register": ("rlplat.controller.decorator", "register"),
    "Dispatch": ("rlplat.controller.decorator", "Dispatch"),
    "Execute": ("rlplat.controller.decorator", "Execute"),
    "WorkerSpec": ("rlplat.controller.host", "WorkerSpec"),
    "ResourcePool": ("rlplat.controller.ray_backend", "ResourcePool"),
    "RayWorkerGroup": ("rlplat.controller.ray_backend", "RayWorkerGroup"),
    "LocalWorkerGroup": ("rlplat.controller.local_backend", "LocalWorkerGroup"),
    "start_ray": ("rlplat.controller.ray_backend", "start_ray"),
    "load_config": ("rlplat.config", "load_config"),
    "read_config_node": ("rlplat.config_node", "read_config_node"),
    "ConfigError": ("rlplat.config_node", "ConfigError"),
    "Trainer": ("rlplat.trainer", "Trainer"),
    "EngineRegistry": ("rlplat.registry", "EngineRegistry"),
    "hookimpl": ("rlplat.hookspecs", "hookimpl"),
    "TrainingEngine": ("rlplat.contracts.engine", "TrainingEngine"),
    "RolloutEngine": ("rlplat.contracts.rollout", "RolloutEngine"),
    "RewardManager": ("rlplat.contracts.reward", "RewardManager"),
    "Algorithm": ("rlplat.contracts.algorithm", "Algorithm"),
}


_lazy_getattr, __dir__ = lazy_names("rlplat", _LAZY_NAMES, globals())


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("rlplat")
    return _lazy_getattr(name)
