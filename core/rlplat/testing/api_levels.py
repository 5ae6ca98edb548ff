"""What a conformance suite asks of an implementation: the requirements of the plugin API version its plugin
declares (:func:`rlplat.api_version.asked_version` of its ``RLPLAT_PLUGIN_API`` range; API 1.0's when it
declares none). A requirement added by a later version is skipped, with the reason, for an implementation
written for an earlier one.

Each suite has a ``plugin_api`` fixture that finds the declared range; a test class overrides it to state
the range itself::

    @pytest.fixture
    def plugin_api(self):
        return ">=1.1,<2"
"""

from __future__ import annotations

from typing import Any

import pytest

from rlplat.api_version import asked_version, asks_at_least, declared_api_of


def implementation_api(implementation: Any, kind: str | None = None, registered_name: str | None = None) -> str | None:
    """The plugin API range declared for ``implementation``: that of the plugin that registered
    ``registered_name`` (of ``kind``) when both are given and it declares one, else the one
    :func:`rlplat.api_version.declared_api_of` finds from where ``implementation`` was defined."""
    if kind is not None and registered_name is not None:
        from rlplat import registry

        declared = registry.plugin(registry.entry(kind, registered_name).plugin).api
        if declared is not None:
            return declared
    return declared_api_of(implementation)


def skip_unless_asked(plugin_api: str | None, version: str, requirement: str) -> None:
    """Skip the running test unless an implementation declaring ``plugin_api`` is held to plugin API
    ``version``'s requirements (``requirement`` says what the test checks)."""
    if not asks_at_least(plugin_api, version):
        declared = plugin_api or "no range (taken as API 1.0)"
        pytest.skip(f"{requirement} is asked from plugin API {version}; this implementation declares {declared}, "
                    f"so API {asked_version(plugin_api)}'s requirements apply")
