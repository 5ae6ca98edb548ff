"""Deprecation, not breakage: a public name, a config key or a contract method that is renamed or removed
keeps working for one minor version of the plugin API (:mod:`rlplat.api_version`), with a
:class:`DeprecationWarning` that names its replacement and the version it goes away in.

* **Names of a module** (a function, a class, a constant): the module keeps the old name through
  :func:`deprecated_names`, its PEP 562 ``__getattr__``::

      __getattr__ = deprecated_names(__name__, {"read_config": Deprecated("read_config_node", "1.2")})

* **Config keys**: a key of rlplat's own run config is listed in :data:`RENAMED_CONFIG_KEYS` (dotted, old ->
  new), which ``load_config`` applies to the YAML file and the overrides; a key of a plugin-owned node is
  listed in its schema's ``RENAMED_KEYS`` class attribute, which :func:`rlplat.config_node.read_config_node`
  applies. The old key is read as the new one; setting both is an error.
* **Contract methods**: ``old = RenamedMethod("new", "1.2")`` in the contract keeps callers of the old name
  working, and a contract whose ``__init_subclass__`` calls :func:`adopt_renamed_methods` keeps
  implementations that still define the old name working (rlplat calls the new name).

* **Modules that moved** (out of core into a plugin distribution, or within core): :func:`moved_module`
  records the old name, and the finder :func:`install_moved_modules` puts first on ``sys.meta_path`` (at
  ``import rlplat``) answers an import of the old name with the new module itself (one module object under
  two names, never a second copy), warning with the new path and the version the old one goes away in;
  without the distribution, the import fails saying what to install.

Nothing here imports anything heavy, or a plugin until an old module name is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable, Mapping

from rlplat.api_version import PLUGIN_API_VERSION


def next_minor(version: str = PLUGIN_API_VERSION) -> str:
    """The minor version after ``version`` (``"1.1.0"`` -> ``"1.2"``): where something deprecated now goes."""
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def warn(old: str, replacement: str, removed_in: str, *, stacklevel: int = 2) -> None:
    """The one deprecation message: ``old`` is deprecated, ``replacement`` is what to use, and the old
    form stops working in plugin API ``removed_in``. ``stacklevel`` counts from the caller of ``warn``."""
    warnings.warn(f"{old} is deprecated and is removed in rlplat plugin API {removed_in}: use {replacement} instead",
                  DeprecationWarning, stacklevel=stacklevel + 1)


# -- names of a module ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Deprecated:
    """A deprecated name of a module: its value now lives at ``target`` (a name of the same module or
    ``"module:attribute"``); ``replacement`` is what the warning tells users to use (default: ``target``,
    spelled ``module.attribute``; for a removal without successor, say what to do instead)."""

    target: str
    removed_in: str
    replacement: str | None = None


def deprecated_names(module_name: str, names: Mapping[str, Deprecated],
                     fallback: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering the deprecated ``names`` (with a warning each time) and passing
    any other name to ``fallback`` (e.g. the module's lazy names) or raising :class:`AttributeError`."""

    def __getattr__(name: str) -> Any:
        deprecated = names.get(name)
        if deprecated is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        target_module, _, attribute = deprecated.target.rpartition(":")
        target_module = target_module or module_name
        replacement = deprecated.replacement or f"{target_module}.{attribute}"
        warn(f"{module_name}.{name}", replacement, deprecated.removed_in)
        return getattr(importlib.import_module(target_module), attribute)

    return __getattr__


# -- config keys ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RenamedKey:
    """A config key now called ``new`` (dotted, from the same root as the old one); the old name stops
    being read in plugin API ``removed_in``."""

    new: str
    removed_in: str


#: rlplat's own run-config keys that were renamed: old dotted key -> :class:`RenamedKey`. Empty: no key of
#: rlplat's config has been renamed yet.
RENAMED_CONFIG_KEYS: dict[str, RenamedKey] = {}


def renamed_keys(values: Mapping[str, Any], renames: Mapping[str, RenamedKey], where: str) -> dict[str, Any]:
    """``values`` (one node, keys without dots) with each old key of ``renames`` moved to its new name and
    a warning naming both (``where.old`` -> ``where.new``). Setting both is a
    :class:`~rlplat.config_node.ConfigError`."""
    moved = dict(values)
    for old, renamed in renames.items():
        if old not in moved:
            continue
        if renamed.new in moved:
            from rlplat.config_node import ConfigError

            raise ConfigError(f"{where}.{old} and {where}.{renamed.new} are both set; {where}.{old} is the old "
                              f"name of {where}.{renamed.new}: keep only {where}.{renamed.new}.")
        warn(f"the config key {where}.{old}", f"{where}.{renamed.new}", renamed.removed_in, stacklevel=3)
        moved[renamed.new] = moved.pop(old)
    return moved


def rename_config_keys(node: Any, source: str, renames: Mapping[str, RenamedKey] | None = None) -> Any:
    """An OmegaConf node of the run config (a YAML file's, or the overrides') with every old dotted key of
    ``renames`` (default :data:`RENAMED_CONFIG_KEYS`) moved to its new key, a warning naming both and
    ``source``; setting both is a :class:`~rlplat.config_node.ConfigError`. Returns the node (changed in
    place)."""
    from omegaconf import OmegaConf

    renames = RENAMED_CONFIG_KEYS if renames is None else renames
    if node is None:
        return node
    for old, renamed in renames.items():
        value = OmegaConf.select(node, old, default=_MISSING)
        if value is _MISSING:
            continue
        if OmegaConf.select(node, renamed.new, default=_MISSING) is not _MISSING:
            from rlplat.config_node import ConfigError

            raise ConfigError(f"{source}: {old} and {renamed.new} are both set; {old} is the old name of "
                              f"{renamed.new}: keep only {renamed.new}.")
        warn(f"the config key {old} ({source})", renamed.new, renamed.removed_in, stacklevel=2)
        parent, _, leaf = old.rpartition(".")
        container = OmegaConf.select(node, parent) if parent else node
        with _writable(container):
            del container[leaf]
        OmegaConf.update(node, renamed.new, value, force_add=True)
    return node


_MISSING = object()


class _writable:
    """Lifts OmegaConf's struct flag on ``node`` for a deletion."""

    def __init__(self, node: Any):
        self.node = node

    def __enter__(self) -> None:
        from omegaconf import OmegaConf

        self.struct = OmegaConf.is_struct(self.node)
        OmegaConf.set_struct(self.node, False)

    def __exit__(self, *exc: Any) -> None:
        from omegaconf import OmegaConf

        OmegaConf.set_struct(self.node, self.struct)


# -- contract methods ----------------------------------------------------------------------------------

class RenamedMethod:
    """``old = RenamedMethod("new", "1.2")`` in a contract class: ``obj.old(...)`` warns and calls
    ``obj.new(...)``. Pair it with :func:`adopt_renamed_methods` for implementations that define ``old``."""

    def __init__(self, new: str, removed_in: str):
        self.new, self.removed_in = new, removed_in
        self.old, self.contract = "?", "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.contract = name, owner.__name__

    def __get__(self, instance: Any, owner: type) -> Any:
        warn(f"{self.contract}.{self.old}()", f"{self.contract}.{self.new}()", self.removed_in)
        return getattr(owner if instance is None else instance, self.new)


def adopt_renamed_methods(cls: type) -> None:
    """For a contract's ``__init_subclass__``: an implementation ``cls`` that defines a method under its old
    name (a :class:`RenamedMethod` of a base) and not under the new one gets it under the new name too, so
    rlplat's calls reach it; a warning at class definition tells its author to rename it."""
    for base in cls.__mro__[1:]:
        for old, value in vars(base).items():
            if not isinstance(value, RenamedMethod) or old not in vars(cls) or value.new in vars(cls):
                continue
            implementation = vars(cls)[old]
            if isinstance(implementation, RenamedMethod):
                continue
            setattr(cls, value.new, implementation)
            warn(f"{cls.__name__}.{old}() ({value.contract}'s old name)", f"{cls.__name__}.{value.new}()",
                 value.removed_in, stacklevel=4)  # the warning points at the class statement


# -- modules that moved -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Moved:
    """``old`` (a module and its submodules) now lives at ``new`` in the distribution ``distribution``;
    the old name is removed in rlplat plugin API ``removed_in``."""

    old: str
    new: str
    distribution: str
    removed_in: str


#: Old module prefix -> where it went. The longest matching prefix wins.
MOVED_MODULES: dict[str, Moved] = {}


def moved_module(old: str, new: str, distribution: str, removed_in: str) -> None:
    """Record that ``old`` moved to ``new`` (in ``distribution``; the old name goes in plugin API ``removed_in``)."""
    MOVED_MODULES[old] = Moved(old, new, distribution, removed_in)


def _moved_target(fullname: str) -> tuple[Moved, str] | None:
    for old in sorted(MOVED_MODULES, key=len, reverse=True):
        if fullname == old or fullname.startswith(old + "."):
            moved = MOVED_MODULES[old]
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
    """Answers imports of the old names in :data:`MOVED_MODULES` with the modules at their new names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        found = _moved_target(fullname)
        if found is None:
            return None
        moved, new_name = found
        return importlib.util.spec_from_loader(fullname, _AliasLoader(moved, new_name))


def install_moved_modules() -> None:
    """Put the finder first on ``sys.meta_path`` (before the path finder, which would otherwise load a
    second copy of a submodule through the aliased package's ``__path__``); idempotent."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


# Plugin API 1.3 moved these out of core (or within it); their old names go in 1.4. (The names 1.2 moved
# were removed in 1.3, as their warnings announced.)
moved_module("rlplat.losses.distillation", "rlplat_distill.losses", "rlplat-distill", "1.4")
moved_module("rlplat.losses.sft", "rlplat_sft.loss", "rlplat-sft", "1.4")
moved_module("rlplat.config.explain", "rlplat.cli.explain", "rlplat", "1.4")
moved_module("rlplat.doctor", "rlplat.cli.doctor", "rlplat", "1.4")
moved_module("rlplat.plan.planner", "rlplat.cli.planner", "rlplat", "1.4")
moved_module("rlplat.plan.estimate", "rlplat.kits.memory", "rlplat", "1.4")
