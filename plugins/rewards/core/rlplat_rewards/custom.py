"""A user's scoring function loaded from a file: ``reward.custom_function.path`` and ``.name``.

The function is called as ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``
and may be ``async def``. :class:`CustomScorer` wraps it: it checks the file and the function when it
is built, checks every return value (a number, or a dict with a numeric ``score``), and pickles as
``(path, name)`` so reward workers load the file themselves.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from rlplat.contracts.reward import split_score
from rlplat_rewards.config import RewardManagerConfig, read_config


def load_function(path: str | Path, name: str) -> Callable[..., Any]:
    """Import ``path`` as a module and return its callable ``name``; errors say which key to fix."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"reward.custom_function.path: no file at {str(file)!r} (cwd {Path.cwd()})")
    module_name = "rlplat_custom_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"reward.custom_function.path: {str(file)!r} cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(
            f"reward.custom_function.name: {str(file)!r} defines no {name!r}; "
            f"its functions are: {', '.join(defined) or 'none'}"
        )
    if not callable(function):
        raise TypeError(f"reward.custom_function.name: {name!r} in {str(file)!r} is a {type(function).__name__}, not a function")
    return function


class CustomScorer:
    """A reward scorer backed by a function in a user's file; see the module docstring."""

    def __init__(self, path: str | Path, name: str = "compute_score"):
        self.path = str(path)
        self.name = name
        self.function = load_function(path, name)
        self.where = f"reward function {name!r} from {self.path}"

    def __reduce__(self):
        return (CustomScorer, (self.path, self.name))

    def __repr__(self) -> str:
        return f"CustomScorer(path={self.path!r}, name={self.name!r})"

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None):
        result = self.function(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )
        if inspect.isawaitable(result):
            return self._checked(result)
        split_score(result, where=self.where)
        return result

    async def _checked(self, awaitable):
        result = await awaitable
        split_score(result, where=self.where)
        return result


def scorer_from_config(config: Any = None) -> Callable[..., Any]:
    """The scorer a ``reward`` node selects: the custom function when ``custom_function.path`` is set,
    otherwise the registered ``reward_scorer`` named by ``scorer``."""
    settings = read_config(config, RewardManagerConfig)
    if settings.custom_function.path:
        return CustomScorer(settings.custom_function.path, settings.custom_function.name)
    from rlplat import registry

    return registry.get("reward_scorer", settings.scorer)
