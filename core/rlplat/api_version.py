"""The version of rlplat's plugin API, and what a plugin's declared range of it means.

A plugin declares the plugin API versions it works with as PEP 440 specifiers, in an attribute of the
module its entry point names (or of the object it names)::

    RLPLAT_PLUGIN_API = ">=1.1,<2"

rlplat loads it only when :data:`PLUGIN_API_VERSION` is in that range; otherwise ``rlplat plugins list``
shows it as failed, with what it declares and what rlplat provides. A plugin that declares nothing is
taken to be written for API 1.0 and loaded by every 1.x (:data:`UNDECLARED`).

The conformance suites of :mod:`rlplat.testing` ask of an implementation what the oldest API version its
range admits asked (:func:`asked_version`): ``">=1.0,<2"`` is held to API 1.0's requirements (a policy
loss supports the four aggregation modes of :data:`LOSS_AGG_MODES_OF_API`), ``">=1.1,<2"`` to 1.1's.
``docs/plugin_api.md`` says what each version added and the deprecation policy.

This module imports nothing at load time (``import rlplat`` reads :data:`PLUGIN_API_VERSION`); the
version arithmetic imports ``packaging`` when it is first needed.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

#: The plugin API this rlplat provides (semver: a new minor version only adds; a major version may remove
#: what a deprecation announced one minor version earlier).
PLUGIN_API_VERSION = "1.3.0"

#: The attribute a plugin declares its range in.
DECLARATION = "RLPLAT_PLUGIN_API"

#: The range assumed of a plugin that declares none.
UNDECLARED = ">=1.0,<2"

#: Every minor version of the plugin API, oldest first.
API_VERSIONS = ("1.0", "1.1", "1.2", "1.3")

#: The aggregation modes (``loss_agg_mode``) each API version asks every policy loss to support; a loss
#: that supports others says so in its registration, ``metadata={"loss_agg_modes": [...]}``.
LOSS_AGG_MODES_OF_API = {
    "1.0": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "1.1": ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "1.2": ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "1.3": ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
}


def specifiers(declared: str) -> Any:
    """``declared`` as a ``packaging.specifiers.SpecifierSet``; :class:`ValueError` saying how to write one."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not isinstance(declared, str):
        raise ValueError(f"{DECLARATION} must be a string of version specifiers such as '>=1.1,<2', "
                         f"got {type(declared).__name__} {declared!r}")
    try:
        return SpecifierSet(declared)
    except InvalidSpecifier as error:
        raise ValueError(f"{DECLARATION} = {declared!r} is not a version range ({error}); write PEP 440 "
                         "specifiers such as '>=1.1,<2'") from None


def admits(declared: str, version: str) -> bool:
    """Whether the range ``declared`` admits the API ``version`` (``"1.1"`` counts as ``"1.1.0"``)."""
    return specifiers(declared).contains(version, prereleases=True)


def incompatibility(declared: str, provided: str = PLUGIN_API_VERSION) -> str | None:
    """Why a plugin declaring ``declared`` cannot run on plugin API ``provided``, or None when it can."""
    try:
        if admits(declared, provided):
            return None
    except ValueError as error:
        return str(error)
    return f"declares plugin API {declared!r} ({DECLARATION}), but this rlplat provides plugin API {provided}"


def asked_version(declared: str | None) -> str:
    """The API version whose requirements apply to an implementation declaring ``declared``: the oldest
    of :data:`API_VERSIONS` the range admits (``"1.0"`` for None, which means :data:`UNDECLARED`).
    :class:`ValueError` when the range admits none of them (it asks for an API this rlplat lacks)."""
    declared = UNDECLARED if declared is None else declared
    for version in API_VERSIONS:
        if admits(declared, version):
            return version
    raise ValueError(f"{DECLARATION} = {declared!r} admits none of the plugin API versions this rlplat knows "
                     f"({', '.join(API_VERSIONS)}; it provides {PLUGIN_API_VERSION})")


def asks_at_least(declared: str | None, version: str) -> bool:
    """Whether an implementation declaring ``declared`` is held to the requirements of ``version``."""
    from packaging.version import Version

    return Version(asked_version(declared)) >= Version(version)


def loss_agg_modes_of(declared: str | None) -> tuple[str, ...]:
    """The aggregation modes a policy loss of a plugin declaring ``declared`` supports, when its
    registration lists none."""
    return LOSS_AGG_MODES_OF_API[asked_version(declared)]


def declaration_of(plugin: Any) -> str | None:
    """The range ``plugin`` declares: its own :data:`DECLARATION` attribute, else its module's."""
    declared = getattr(plugin, DECLARATION, None)
    if declared is None and not isinstance(plugin, type(sys)):
        module = sys.modules.get(getattr(plugin, "__module__", None) or type(plugin).__module__)
        declared = getattr(module, DECLARATION, None)
    return declared


def is_rlplat_module(module_name: str) -> bool:
    return module_name == "rlplat" or module_name.startswith("rlplat.")


def declared_api_of(implementation: Any) -> str | None:
    """The range declared for ``implementation`` (a function, class or instance a plugin provides):
    its own attribute, its module's or a parent package's, else that of the ``rlplat`` entry point in the
    same top-level package. rlplat's own implementations provide exactly :data:`PLUGIN_API_VERSION`.
    None when nothing is declared."""
    declared = getattr(implementation, DECLARATION, None)
    if declared is not None:
        return declared
    module_name = getattr(implementation, "__module__", None) or type(implementation).__module__
    if not isinstance(module_name, str):
        return None
    if is_rlplat_module(module_name):
        return f"=={PLUGIN_API_VERSION}"
    parts = module_name.split(".")
    for depth in range(len(parts), 0, -1):
        declared = getattr(sys.modules.get(".".join(parts[:depth])), DECLARATION, None)
        if declared is not None:
            return declared
    for entry_point in importlib.metadata.entry_points(group="rlplat"):
        if entry_point.module.split(".")[0] != parts[0]:
            continue
        try:
            plugin = entry_point.load()
        except Exception:
            continue  # reported by the registry as a failed plugin; nothing declared here
        declared = declaration_of(plugin)
        if declared is not None:
            return declared
    return None
