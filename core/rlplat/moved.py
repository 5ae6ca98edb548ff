"""Modules that left core keep importing under their old names for one minor version.

When a feature moves out of core into a plugin distribution (``rlplat.demo`` -> ``rlplat_demo`` in
``rlplat-demo``), ``import rlplat.demo.tools`` still works: the import is answered with the new module
itself (one module object under two names, never a second copy) and a :class:`DeprecationWarning` names the
new path and the plugin API version the old one goes away in (one minor version after the move). Without the distribution the import fails with an
error that says what to install. Installed by ``import rlplat`` (a finder at the front of
``sys.meta_path``); nothing here imports a plugin until an old name is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any


@dataclasses.dataclass(frozen=True)
class Moved:
    """``old`` (a module and its submodules) now lives at ``new`` in the distribution ``distribution``;
    the old name is removed in rlplat plugin API ``removed_in``."""

    old: str
    new: str
    distribution: str
    removed_in: str


#: Old module prefix -> where it went. The longest matching prefix wins (``rlplat.demo.scorer`` before
#: ``rlplat.demo``).
MOVED: dict[str, Moved] = {}


def add(old: str, new: str, distribution: str, removed_in: str) -> None:
    """Record that ``old`` moved to ``new`` (in ``distribution``; the old name goes in plugin API ``removed_in``)."""
    MOVED[old] = Moved(old, new, distribution, removed_in)


def _target(fullname: str) -> tuple[Moved, str] | None:
    for old in sorted(MOVED, key=len, reverse=True):
        if fullname == old or fullname.startswith(old + "."):
            moved = MOVED[old]
            return moved, moved.new + fullname[len(old):]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, moved: Moved, target: str):
        self.moved, self.target = moved, target

    def create_module(self, spec: Any) -> Any:
        moved = self.moved
        warnings.warn(f"{spec.name} moved to {self.target} (distribution {moved.distribution}); the old name is "
                      f"removed in rlplat plugin API {moved.removed_in}", DeprecationWarning, stacklevel=2)
        try:
            return importlib.import_module(self.target)
        except ModuleNotFoundError as error:
            if error.name and (self.target == error.name or self.target.startswith(error.name + ".")):
                raise ModuleNotFoundError(
                    f"{spec.name} moved to {self.target}, which is not installed: pip install {moved.distribution}",
                    name=spec.name) from None
            raise

    def exec_module(self, module: Any) -> None:
        pass  # the target module ran when it was imported


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers imports of the old names in :data:`MOVED` with the modules at their new names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        found = _target(fullname)
        if found is None:
            return None
        moved, new_name = found
        return importlib.util.spec_from_loader(fullname, _AliasLoader(moved, new_name))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (before the path finder, which would otherwise load a
    second copy of a submodule through the aliased package's ``__path__``); idempotent."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


# Plugin API 1.2 moved these out of core (or within it); their old names go in 1.3.
add("rlplat.demo.scorer", "rlplat.scorers", "rlplat", "1.3")
add("rlplat.agent", "rlplat_agents", "rlplat-agents", "1.3")
add("rlplat.agent.sandbox", "rlplat_python_tool.sandbox", "rlplat-python-tool", "1.3")
add("rlplat.cli.check_template", "rlplat_agents.check_template", "rlplat-agents", "1.3")
add("rlplat.judge", "rlplat_judge.manager", "rlplat-judge", "1.3")
add("rlplat.judge_parsers", "rlplat_judge.parsers", "rlplat-judge", "1.3")
add("rlplat.reward_model", "rlplat_reward_model.config", "rlplat-reward-model", "1.3")
add("rlplat.workers.reward_model", "rlplat_reward_model.worker", "rlplat-reward-model", "1.3")
add("rlplat.reward_loop", "rlplat_rewards.reward_loop", "rlplat-rewards", "1.3")
add("rlplat.plan.measure", "rlplat.testing.memory", "rlplat", "1.3")
add("rlplat.sft", "rlplat_sft", "rlplat-sft", "1.3")
add("rlplat.cli.sft", "rlplat_sft.command", "rlplat-sft", "1.3")
add("rlplat.demo", "rlplat_demo", "rlplat-demo", "1.3")
add("rlplat.verl_keys", "rlplat_verl", "rlplat-verl", "1.3")
# Plugin API 1.2 gave the run config and the trainer folders of their own.
add("rlplat.config_components", "rlplat.config.components", "rlplat", "1.3")
add("rlplat.config_explain", "rlplat.config.explain", "rlplat", "1.3")
add("rlplat.trainer_config", "rlplat.config.trainer", "rlplat", "1.3")
add("rlplat.pipeline", "rlplat.trainer.pipeline", "rlplat", "1.3")
add("rlplat.sync_probe", "rlplat.trainer.sync_probe", "rlplat", "1.3")
add("rlplat.placement", "rlplat.trainer.placement", "rlplat", "1.3")
add("rlplat.checkpoint", "rlplat.trainer.checkpoint", "rlplat", "1.3")
add("rlplat.tracking", "rlplat.trainer.tracking", "rlplat", "1.3")
# Plugin API 1.2 put the kits in a folder of their own.
add("rlplat.engine_kit", "rlplat.kits.engine", "rlplat", "1.3")
add("rlplat.rollout_batch", "rlplat.kits.rollout_batch", "rlplat", "1.3")
add("rlplat.rollout_server", "rlplat.kits.rollout_server", "rlplat", "1.3")
add("rlplat.reward_kit", "rlplat.kits.reward", "rlplat", "1.3")
add("rlplat.advantages", "rlplat.kits.advantages", "rlplat", "1.3")
add("rlplat.aio", "rlplat.kits.aio", "rlplat", "1.3")
