"""Finding and loading plugins: the ``rlplat`` entry-point group, the user's switches, the pluggy manager.

Two environment variables give the user control, as pytest and llm do:

``RLPLAT_DISABLE_PLUGIN_AUTOLOAD=1``
    Load no entry point at all. Plugins registered in Python with
    :meth:`rlplat.registry.Registry.register_plugin` still work.
``RLPLAT_PLUGINS=a,b``
    Load only these entry points; each name may be an entry-point name or a distribution name.
    The others are listed as ``disabled`` and are not imported.

A plugin that raises while importing, fails pluggy's validation or raises inside a hook is recorded as
``failed`` with its error and traceback; every other plugin still loads. So is one whose declared plugin
API range (``RLPLAT_PLUGIN_API``, :mod:`rlplat.api_version`) does not admit this rlplat's: it is imported
(the declaration is an attribute of its module) but none of its hooks is called.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import traceback
from typing import Any, Callable, Iterator, Mapping

import pluggy

from rlplat import api_version, hookspecs

ENTRY_POINT_GROUP = "rlplat"
ENV_ALLOW_LIST = "RLPLAT_PLUGINS"
ENV_DISABLE_AUTOLOAD = "RLPLAT_DISABLE_PLUGIN_AUTOLOAD"

#: Registry kind -> the hook that fills it. The kind names are fixed by the design.
HOOK_OF_KIND: dict[str, str] = {
    "engine": "register_engines",
    "rollout": "register_rollouts",
    "reward_manager": "register_reward_managers",
    "reward_scorer": "register_reward_scorers",
    "advantage_estimator": "register_advantage_estimators",
    "policy_loss": "register_policy_losses",
    "algorithm": "register_algorithms",
    "dispatch_mode": "register_dispatch_modes",
    "command": "register_commands",
    "role": "register_roles",
    "agent_loop": "register_agent_loops",
    "tool": "register_tools",
    "tool_parser": "register_tool_parsers",
    "environment": "register_environments",
    "judge_parser": "register_judge_parsers",
    "preset": "register_presets",
    "config_translator": "register_config_translators",
    "config_node": "register_config_nodes",
    "rollout_driver": "register_rollout_drivers",
    "step_observer": "register_step_observers",
}
KINDS: tuple[str, ...] = tuple(HOOK_OF_KIND)


@dataclasses.dataclass
class PluginRecord:
    """What is known about one plugin, whether or not it loaded.

    ``status`` is ``"ok"``, ``"failed"`` (``reason`` and ``traceback`` say why) or ``"disabled"``
    (the user's switches excluded it; it was not imported). ``api`` is the plugin API range it declares
    (None: none, or it was not imported).
    """

    name: str
    module: str | None
    distribution: str | None
    version: str | None
    status: str = "ok"
    reason: str | None = None
    traceback: str | None = None
    api: str | None = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An entry point of the ``rlplat`` group, not yet imported."""

    name: str
    module: str
    distribution: str | None
    version: str | None
    entry_point: importlib.metadata.EntryPoint


def is_truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def allow_list(environ: Mapping[str, str]) -> set[str] | None:
    """The names in ``RLPLAT_PLUGINS``, or None when it is unset (everything is allowed)."""
    raw = environ.get(ENV_ALLOW_LIST)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def discover(group: str = ENTRY_POINT_GROUP) -> Iterator[Candidate]:
    """Every entry point of ``group`` in installation order, without importing any of them.

    A distribution installed twice on the path (e.g. an editable and a regular install) is reported
    once, as importlib.metadata would import it.
    """
    seen: set[tuple[str, str]] = set()
    for entry_point in importlib.metadata.entry_points(group=group):
        key = (entry_point.name, entry_point.value)
        if key in seen:
            continue
        seen.add(key)
        dist = getattr(entry_point, "dist", None)
        yield Candidate(
            name=entry_point.name,
            module=entry_point.value,
            distribution=dist.metadata["Name"] if dist is not None else None,
            version=dist.version if dist is not None else None,
            entry_point=entry_point,
        )


def new_plugin_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


def describe_exception(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def import_candidate(candidate: Candidate, record: PluginRecord) -> Any | None:
    """Import one entry point; on failure fill ``record`` and return None."""
    try:
        return candidate.entry_point.load()
    except BaseException as error:  # a plugin may raise anything, SystemExit included
        if isinstance(error, KeyboardInterrupt):
            raise
        record.status = "failed"
        record.reason = f"import of {candidate.module!r} raised {describe_exception(error)}"
        record.traceback = traceback.format_exc()
        return None


def check_plugin_api(plugin: Any, record: PluginRecord) -> bool:
    """Whether the plugin API range ``plugin`` declares (if any) admits this rlplat's; when it does not,
    ``record`` says ``failed`` with what the plugin declares, what rlplat provides and what to do."""
    record.api = api_version.declaration_of(plugin)
    if record.api is None:
        return True
    problem = api_version.incompatibility(record.api)
    if problem is None:
        return True
    distribution = record.distribution or "the plugin"
    record.status = "failed"
    record.reason = (f"{problem}: install a release of {distribution} made for plugin API "
                     f"{api_version.PLUGIN_API_VERSION}, or an rlplat whose plugin API it admits")
    return False


def call_hooks_of(
    manager: pluggy.PluginManager, plugin: Any, make_register: Callable[[str], Callable[..., None]]
) -> None:
    """Call every ``register_*`` hook that ``plugin`` implements, with a ``register`` bound to its kind.

    The hooks are called one plugin at a time (not through ``manager.hook``) so that each
    registration is attributed to the plugin that made it and a plugin that raises can be isolated.
    """
    for kind, hook_name in HOOK_OF_KIND.items():
        caller = getattr(manager.hook, hook_name)
        for implementation in caller.get_hookimpls():
            if implementation.plugin is not plugin:
                continue
            arguments = {"register": make_register(kind)}
            implementation.function(**{name: arguments[name] for name in implementation.argnames})
