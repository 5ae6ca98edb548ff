"""Reward scorers core owns: the default one (exact match) and a user's function loaded from a file.

``reward.scorer`` names a registered scorer (kind ``reward_scorer``); ``reward.custom_function.path`` /
``.name`` name a function in the user's file instead. Giving both is a config error. Giving neither uses
:class:`DataSourceScorer`: each row goes to the registered scorer that claims its ``data_source`` (an
entry's ``metadata={"data_sources": [...]}``, e.g. ``gsm8k`` claims ``openai/gsm8k`` as verl's default
reward does), and rows no scorer claims to :func:`exact_match` (registered by rlplat as ``exact_match``;
the demo's reward). :func:`scorer_for` makes the choice, for the driver and for ``load_config``'s checks.
An entry's ``metadata={"safe": True}`` says the scorer returns promptly on any input (no regular expression
that can backtrack catastrophically, no unbounded arithmetic): reward managers may then score it in their own
process rather than in a scorer process they can kill at a deadline (``exact_match`` is registered so).

A custom function is called as ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``
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

def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict:
    """``{"score": 1.0, "acc": True}`` when ``solution_str`` is ``ground_truth`` once surrounding whitespace
    is stripped from both, else ``{"score": 0.0, "acc": False}``. No partial credit: the warm-started demo
    model is right often enough for GRPO groups to hold both outcomes."""
    correct = solution_str.strip() == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct}


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


class DataSourceScorer:
    """The default scorer: a row's ``data_source`` picks the registered scorer that claims it (entry
    metadata ``data_sources``); unclaimed sources are scored by :func:`exact_match`. Two scorers claiming
    one source is a ``ValueError`` naming both. Pickles as nothing: each process reads its own registry."""

    def __init__(self) -> None:
        self._claims: dict[str, str] | None = None

    def __reduce__(self):
        return (DataSourceScorer, ())

    def __repr__(self) -> str:
        return "DataSourceScorer()"

    def claims(self) -> dict[str, str]:
        """``data_source -> scorer name`` of every registered scorer that claims sources."""
        if self._claims is None:
            from rlplat import registry

            claims: dict[str, str] = {}
            for entry in registry.entries("reward_scorer"):
                for source in entry.metadata.get("data_sources", ()):
                    if source in claims:
                        raise ValueError(
                            f"data_source {source!r} is claimed by reward scorers {claims[source]!r} and {entry.name!r}; "
                            "name one with reward.scorer"
                        )
                    claims[source] = entry.name
            self._claims = claims
        return self._claims

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None):
        name = self.claims().get(data_source)
        if name is None:
            return exact_match(data_source, solution_str, ground_truth, extra_info)
        from rlplat import registry

        return registry.get("reward_scorer", name)(data_source=data_source, solution_str=solution_str,
                                                   ground_truth=ground_truth, extra_info=extra_info)


def scorer_for(scorer: str | None, custom_path: str | None, custom_name: str = "compute_score") -> Callable[..., Any]:
    """The scorer a ``reward`` node selects: the custom function when ``custom_path`` is set, else the
    registered scorer ``scorer``, else a :class:`DataSourceScorer`. Both set is a ``ValueError`` naming them."""
    if custom_path and scorer:
        raise ValueError(
            f"reward.scorer={scorer!r} and reward.custom_function.path={custom_path!r} are both set; "
            "a run has one scorer: remove one of them"
        )
    if custom_path:
        return CustomScorer(custom_path, custom_name)
    if scorer is None:
        default = DataSourceScorer()
        default.claims()  # two scorers claiming one data source are reported here, at config load
        return default
    from rlplat import registry

    return registry.get("reward_scorer", scorer)
