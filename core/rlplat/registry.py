"""The one registry: kind -> name -> factory and metadata, filled only through the plugin hooks.

Use the module-level functions, which act on the process-wide registry::

    from rlplat import registry
    registry.names("engine")                # ['fsdp2', 'megatron']
    EngineCls = registry.get("engine", "fsdp2")
    registry.entry("rollout", "vllm").status  # 'unavailable: vllm is not installed (pip install ...)'

Plugins are discovered on first use (entry-point group ``rlplat``, see :mod:`rlplat.plugins`). Nothing
is registered as a side effect of importing a module. Looking entries up imports no plugin code; only
:func:`get` (or :meth:`Entry.load`) imports the module behind an entry.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import threading
import traceback
from typing import Any, Callable, Iterable, Mapping, Sequence

from rlplat import plugins as plugin_loading
from rlplat.plugins import KINDS, PluginRecord


class RegistryError(LookupError):
    """Base class of every registry error; the message is written for the user."""


class UnknownKindError(RegistryError):
    pass


class UnknownEntryError(RegistryError):
    pass


class DuplicateEntryError(RegistryError):
    pass


class UnavailableError(RegistryError):
    pass


class EntryLoadError(RegistryError):
    pass


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered thing. ``factory`` is the object or a ``"module:attribute"`` path."""

    kind: str
    name: str
    factory: Any
    plugin: str
    distribution: str | None
    version: str | None
    description: str = ""
    requires: tuple[str, ...] = ()
    install_hint: str | None = None
    config_schema: Any = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def origin(self) -> str:
        """Who registered it, for messages: ``"rlplat-rewards 0.1.0 (plugin 'rewards')"``."""
        distribution = self.distribution or "no distribution"
        version = f" {self.version}" if self.version else ""
        return f"{distribution}{version} (plugin {self.plugin!r})"

    def missing_requirements(self) -> list[str]:
        """The optional dependencies in ``requires`` that cannot be found (nothing is imported)."""
        return [name for name in self.requires if not is_importable(name)]

    @property
    def status(self) -> str:
        missing = self.missing_requirements()
        if not missing:
            return "ok"
        return "unavailable: " + unavailable_reason(missing, self.install_hint)

    @property
    def needs_gpu(self) -> bool:
        """``metadata["needs_gpu"]``: a bool, or the ``"module:function"`` path of a function of no argument
        that answers (e.g. from which build of a backend is installed; it must not import the backend)."""
        value = self.metadata.get("needs_gpu", False)
        if not isinstance(value, str):
            return bool(value)
        try:
            return bool(resolve_dotted_path(value)())
        except Exception as error:
            raise EntryLoadError(f"{self.kind} {self.name!r} from {self.origin}: its metadata needs_gpu={value!r} could not be "
                                 f"answered: {plugin_loading.describe_exception(error)}") from error

    def load(self) -> Any:
        """The factory itself: resolves a dotted path (importing its module) after checking ``requires``."""
        missing = self.missing_requirements()
        if missing:
            raise UnavailableError(
                f"{self.kind} {self.name!r} is unavailable: "
                f"{unavailable_reason(missing, self.install_hint)} [registered by {self.origin}]"
            )
        if not isinstance(self.factory, str):
            return self.factory
        try:
            return resolve_dotted_path(self.factory)
        except Exception as error:
            raise EntryLoadError(
                f"{self.kind} {self.name!r} from {self.origin} could not be loaded from "
                f"{self.factory!r}: {plugin_loading.describe_exception(error)}"
            ) from error


def is_importable(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def unavailable_reason(missing: Sequence[str], install_hint: str | None) -> str:
    verb = "is" if len(missing) == 1 else "are"
    reason = f"{', '.join(missing)} {verb} not installed"
    return f"{reason} ({install_hint})" if install_hint else reason


def resolve_dotted_path(path: str) -> Any:
    """``"package.module:attr.sub"`` (or ``"package.module.attr"``) -> the object."""
    if ":" in path:
        module_name, _, attribute_path = path.partition(":")
    else:
        module_name, _, attribute_path = path.rpartition(".")
    target: Any = importlib.import_module(module_name)
    for part in filter(None, attribute_path.split(".")):
        target = getattr(target, part)
    return target


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (difflib's ratio of at least 0.5), or None: rlplat's one rule for
    suggestions, used by the registry, the config reader and every error that offers one."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "", quote: str = "'") -> str:
    """``" Did you mean 'PREFIXmatch'?"`` for the :func:`closest` candidate, else ``""``."""
    match = closest(str(name), candidates)
    return f" Did you mean {quote}{prefix}{match}{quote}?" if match else ""


class Registry:
    """Holds every entry of every kind and the record of every plugin.

    ``environ`` is read when plugins are first loaded (defaults to ``os.environ``); ``group`` is the
    entry-point group searched. rlplat's own entries (:mod:`rlplat.builtin_plugin`) are loaded first
    unless ``include_builtins`` is False. A fresh ``Registry`` is independent of the process-wide one,
    which is what the tests of rlplat and of plugins use.
    """

    def __init__(
        self,
        group: str = plugin_loading.ENTRY_POINT_GROUP,
        environ: Mapping[str, str] | None = None,
        include_builtins: bool = True,
    ):
        self.group = group
        self._environ = environ
        self._include_builtins = include_builtins
        self._lock = threading.RLock()
        self._loaded = False
        self._manager = plugin_loading.new_plugin_manager()
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._conflicts: dict[tuple[str, str], list[Entry]] = {}
        self._plugins: dict[str, PluginRecord] = {}

    # -- loading ---------------------------------------------------------------------------------------

    def load(self) -> None:
        """Discover and load the entry-point plugins once; later calls do nothing."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self._include_builtins:
                from importlib.metadata import version

                from rlplat import builtin_plugin

                record = PluginRecord("rlplat", builtin_plugin.__name__, "rlplat", version("rlplat"),
                                      api=f"=={plugin_loading.api_version.PLUGIN_API_VERSION}")
                self._plugins[record.name] = record
                self._activate(builtin_plugin, record)
            environ = os.environ if self._environ is None else self._environ
            autoload_disabled = plugin_loading.is_truthy(environ.get(plugin_loading.ENV_DISABLE_AUTOLOAD))
            allowed = plugin_loading.allow_list(environ)
            for candidate in plugin_loading.discover(self.group):
                record = PluginRecord(candidate.name, candidate.module, candidate.distribution, candidate.version)
                if candidate.name in self._plugins:
                    record.status, record.reason = "failed", (
                        f"entry point name {candidate.name!r} is also used by "
                        f"{self._plugins[candidate.name].distribution}; rename one of them"
                    )
                    self._plugins[f"{candidate.name} ({candidate.distribution})"] = record
                    continue
                self._plugins[candidate.name] = record
                if autoload_disabled:
                    record.status, record.reason = "disabled", f"{plugin_loading.ENV_DISABLE_AUTOLOAD} is set"
                    continue
                if allowed is not None and not allowed & {candidate.name, candidate.distribution}:
                    record.status, record.reason = "disabled", f"not named in {plugin_loading.ENV_ALLOW_LIST}"
                    continue
                plugin = plugin_loading.import_candidate(candidate, record)
                if plugin is not None and plugin_loading.check_plugin_api(plugin, record):
                    self._activate(plugin, record)

    def register_plugin(
        self, plugin: Any, name: str | None = None, distribution: str | None = None, version: str | None = None
    ) -> PluginRecord:
        """Register a plugin object or module from Python (a notebook, a test, a custom pipeline).

        Returns its record; when one of its hooks raised, or the plugin API range it declares does not
        admit this rlplat's, the record says ``failed`` and nothing it registered is kept.
        """
        self.load()
        with self._lock:
            name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
            if name in self._plugins:
                raise RegistryError(f"a plugin named {name!r} is already registered; pass another name=")
            module = getattr(plugin, "__name__", None) if hasattr(plugin, "__file__") else None
            record = PluginRecord(name, module, distribution, version)
            self._plugins[name] = record
            if plugin_loading.check_plugin_api(plugin, record):
                self._activate(plugin, record)
            return record

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin and everything it registered."""
        with self._lock:
            if name not in self._plugins:
                raise RegistryError(f"no plugin named {name!r}; registered: {', '.join(self._plugins) or 'none'}")
            del self._plugins[name]
            if self._manager.has_plugin(name):
                self._manager.unregister(name=name)
            self._forget_entries_of(name)

    def _activate(self, plugin: Any, record: PluginRecord) -> None:
        try:
            self._manager.register(plugin, name=record.name)
            self._manager.check_pending()
        except Exception as error:
            if self._manager.has_plugin(record.name):
                self._manager.unregister(name=record.name)
            record.status, record.reason = "failed", plugin_loading.describe_exception(error)
            record.traceback = traceback.format_exc()
            return
        try:
            plugin_loading.call_hooks_of(self._manager, plugin, lambda kind: self._register_callback(kind, record))
        except Exception as error:
            self._manager.unregister(name=record.name)
            self._forget_entries_of(record.name)
            record.status = "failed"
            record.reason = f"a register hook raised {plugin_loading.describe_exception(error)}"
            record.traceback = traceback.format_exc()

    def _register_callback(self, kind: str, record: PluginRecord) -> Callable[..., None]:
        def register(
            name: str,
            factory: Any,
            *,
            description: str = "",
            requires: Sequence[str] = (),
            install_hint: str | None = None,
            config_schema: Any = None,
            metadata: Mapping[str, Any] | None = None,
        ) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"register() needs a non-empty string name for a {kind}, got {name!r}")
            if factory is None:
                raise TypeError(f"register({name!r}) got factory=None; pass the object or a 'module:attr' path")
            if isinstance(requires, str):
                requires = (requires,)
            entry = Entry(
                kind=kind,
                name=name,
                factory=factory,
                plugin=record.name,
                distribution=record.distribution,
                version=record.version,
                description=description,
                requires=tuple(requires),
                install_hint=install_hint,
                config_schema=config_schema,
                metadata=dict(metadata or {}),
            )
            self._add(entry)

        return register

    def _add(self, entry: Entry) -> None:
        key = (entry.kind, entry.name)
        if key in self._conflicts:
            self._conflicts[key].append(entry)
            return
        existing = self._entries[entry.kind].pop(entry.name, None)
        if existing is None:
            self._entries[entry.kind][entry.name] = entry
        else:
            self._conflicts[key] = [existing, entry]

    def _forget_entries_of(self, plugin_name: str) -> None:
        for entries in self._entries.values():
            for name in [n for n, e in entries.items() if e.plugin == plugin_name]:
                del entries[name]
        for key in list(self._conflicts):
            remaining = [e for e in self._conflicts[key] if e.plugin != plugin_name]
            if len(remaining) == 1:
                self._entries[key[0]][key[1]] = remaining[0]
                del self._conflicts[key]
            elif not remaining:
                del self._conflicts[key]
            else:
                self._conflicts[key] = remaining

    # -- lookup ----------------------------------------------------------------------------------------

    def _check_kind(self, kind: str) -> None:
        if kind not in self._entries:
            raise UnknownKindError(f"unknown registry kind {kind!r}; the kinds are: {', '.join(KINDS)}.{did_you_mean(kind, KINDS)}")

    def entry(self, kind: str, name: str) -> Entry:
        """The entry's metadata, without importing it. Raises a :class:`RegistryError` that explains."""
        self.load()
        self._check_kind(kind)
        with self._lock:
            if (kind, name) in self._conflicts:
                origins = " and ".join(e.origin for e in self._conflicts[(kind, name)])
                raise DuplicateEntryError(
                    f"{kind} {name!r} is registered more than once: by {origins}. Uninstall one of these "
                    f"distributions, or load only one of them with {plugin_loading.ENV_ALLOW_LIST}=..."
                )
            found = self._entries[kind].get(name)
            if found is not None:
                return found
            raise UnknownEntryError(self._unknown_message(kind, name))

    def _unknown_message(self, kind: str, name: str) -> str:
        available = sorted(self._entries[kind]) + sorted(n for k, n in self._conflicts if k == kind)
        message = f"unknown {kind} {name!r}; available: {', '.join(available) if available else 'none'}."
        message += did_you_mean(name, available)
        failed = [p for p in self._plugins.values() if p.status == "failed"]
        disabled = [p for p in self._plugins.values() if p.status == "disabled"]
        if failed:
            message += " Plugins that failed to load: " + "; ".join(f"{p.name} ({p.reason})" for p in failed) + "."
        if disabled:
            message += f" Disabled plugins: {', '.join(p.name for p in disabled)}."
        if failed or disabled:
            message += " See `rlplat plugins list`."
        return message

    def get(self, kind: str, name: str) -> Any:
        """The registered object (importing its module if it was given as a dotted path)."""
        return self.entry(kind, name).load()

    def names(self, kind: str, available_only: bool = False) -> list[str]:
        """Sorted names of ``kind``; conflicted names are included unless ``available_only``."""
        self.load()
        self._check_kind(kind)
        with self._lock:
            names = [n for n, e in self._entries[kind].items() if not available_only or e.status == "ok"]
            if not available_only:
                names += [n for k, n in self._conflicts if k == kind]
            return sorted(names)

    def entries(self, kind: str | None = None) -> list[Entry]:
        """Every usable-or-unavailable entry (conflicted ones excluded), optionally of one kind."""
        self.load()
        if kind is not None:
            self._check_kind(kind)
        with self._lock:
            kinds = [kind] if kind else list(KINDS)
            return [e for k in kinds for _, e in sorted(self._entries[k].items())]

    def conflicts(self) -> dict[tuple[str, str], list[Entry]]:
        """``(kind, name) -> the entries that claim it``."""
        self.load()
        with self._lock:
            return {key: list(value) for key, value in self._conflicts.items()}

    def plugins(self) -> list[PluginRecord]:
        """Every plugin seen: loaded, failed or disabled, in discovery order."""
        self.load()
        with self._lock:
            return list(self._plugins.values())

    def plugin(self, name: str) -> PluginRecord:
        self.load()
        with self._lock:
            if name in self._plugins:
                return self._plugins[name]
            for record in self._plugins.values():
                if record.distribution == name:
                    return record
            raise UnknownEntryError(
                f"unknown plugin {name!r}; loaded plugins: {', '.join(self._plugins) or 'none'}.{did_you_mean(name, self._plugins)}"
            )

    def entries_of_plugin(self, name: str) -> list[Entry]:
        """What one plugin registered, conflicted entries included."""
        self.load()
        with self._lock:
            own = [e for entries in self._entries.values() for e in entries.values() if e.plugin == name]
            own += [e for entries in self._conflicts.values() for e in entries if e.plugin == name]
            return sorted(own, key=lambda e: (KINDS.index(e.kind), e.name))


class EngineRegistry:
    """The typed view of the registry for training engines (``kind="engine"``) or rollouts (``"rollout"``).

    ``build(name, config, **kwargs)`` resolves the factory and calls it; ``why_unavailable(name)``
    returns the reason an engine cannot be used here, or None when it can.
    """

    def __init__(self, kind: str = "engine", registry: Registry | None = None):
        if kind not in ("engine", "rollout"):
            raise ValueError(f"EngineRegistry serves kind 'engine' or 'rollout', not {kind!r}")
        self.kind = kind
        self.registry = registry or default

    def names(self, available_only: bool = False) -> list[str]:
        return self.registry.names(self.kind, available_only=available_only)

    def why_unavailable(self, name: str) -> str | None:
        try:
            entry = self.registry.entry(self.kind, name)
        except RegistryError as error:
            return str(error)
        status = entry.status
        return None if status == "ok" else status

    def build(self, name: str, config: Any = None, **kwargs: Any) -> Any:
        factory = self.registry.get(self.kind, name)
        return factory(config, **kwargs)


#: The process-wide registry behind the functions below.
default = Registry()

load = default.load
get = default.get
entry = default.entry
names = default.names
entries = default.entries
conflicts = default.conflicts
plugins = default.plugins
plugin = default.plugin
entries_of_plugin = default.entries_of_plugin
register_plugin = default.register_plugin
unregister_plugin = default.unregister_plugin
