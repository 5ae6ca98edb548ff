"""rlplat.PLUGIN_API_VERSION and the range a plugin declares: a plugin outside it is not loaded and is listed
as failed with what it declares and what rlplat provides; no declaration is API 1.x; the conformance
suites hold an implementation to the oldest API version its range admits."""

from __future__ import annotations

import json
import uuid

import pytest

import rlplat
from rlplat.api_version import (API_VERSIONS, LOSS_AGG_MODES_OF_API, PLUGIN_API_VERSION, asked_version, declared_api_of,
                                incompatibility, loss_agg_modes_of)
from rlplat.losses.config import LOSS_AGG_MODES
from rlplat.registry import Registry, UnknownEntryError


def unique(prefix: str) -> str:
    """Module names unique per test: imported modules stay in sys.modules for the whole session."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def scorer_plugin(module: str, declaration: str | None) -> dict[str, str]:
    declared = f"RLPLAT_PLUGIN_API = {declaration!r}\n" if declaration is not None else ""
    return {module: f"""
        import rlplat
        {declared}
        @rlplat.hookimpl
        def register_reward_scorers(register):
            register("{module}_score", "json:dumps")
    """}


def test_the_api_version_is_semver_and_the_newest_known_minor_version():
    assert rlplat.PLUGIN_API_VERSION == PLUGIN_API_VERSION == "1.3.0"
    assert PLUGIN_API_VERSION.startswith(API_VERSIONS[-1] + ".")


def test_api_1_0_asked_four_aggregation_modes_and_1_1_adds_token_sum():
    assert LOSS_AGG_MODES_OF_API["1.0"] == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    assert set(LOSS_AGG_MODES_OF_API["1.1"]) - set(LOSS_AGG_MODES_OF_API["1.0"]) == {"token-sum"}
    assert set(LOSS_AGG_MODES_OF_API["1.1"]) == set(LOSS_AGG_MODES)


@pytest.mark.parametrize(("declared", "asked"), [
    (None, "1.0"), (">=1.0,<2", "1.0"), ("~=1.0", "1.0"), (">=1.1,<2", "1.1"), ("==1.1.0", "1.1"), ("==1.*", "1.0"),
])
def test_an_implementation_is_held_to_the_oldest_version_its_range_admits(declared, asked):
    assert asked_version(declared) == asked


def test_a_range_admitting_no_known_version_cannot_be_tested():
    with pytest.raises(ValueError, match=r"RLPLAT_PLUGIN_API = '>=2' admits none of the plugin API versions this "
                                         r"rlplat knows \(1.0, 1.1, 1.2, 1.3; it provides 1.3.0\)"):
        asked_version(">=2")


def test_an_undeclared_loss_supports_api_1_0s_modes():
    assert loss_agg_modes_of(None) == LOSS_AGG_MODES_OF_API["1.0"]
    assert loss_agg_modes_of(">=1.1,<2") == LOSS_AGG_MODES_OF_API["1.1"]


@pytest.mark.parametrize(("declared", "reason"), [
    (">=1.0,<2", None),
    (">=1.1", None),
    (">=2", "declares plugin API '>=2' (RLPLAT_PLUGIN_API), but this rlplat provides plugin API 1.3.0"),
    ("<1.1", "declares plugin API '<1.1' (RLPLAT_PLUGIN_API), but this rlplat provides plugin API 1.3.0"),
])
def test_incompatibility_says_what_is_declared_and_what_is_provided(declared, reason):
    assert incompatibility(declared) == reason


def test_a_declaration_that_is_not_a_range_is_an_incompatibility_saying_how_to_write_one():
    assert incompatibility("one point oh").startswith("RLPLAT_PLUGIN_API = 'one point oh' is not a version range")
    assert incompatibility(1.1) == "RLPLAT_PLUGIN_API must be a string of version specifiers such as '>=1.1,<2', got float 1.1"


def test_a_plugin_declaring_an_incompatible_range_is_failed_with_both_versions_and_registers_nothing(write_dist):
    module = unique("future")
    write_dist("rlplat-future", "3.0.0", {"future": module}, scorer_plugin(module, ">=2"))
    registry = Registry()
    record = registry.plugin("future")
    assert (record.status, record.api) == ("failed", ">=2")
    assert record.reason == ("declares plugin API '>=2' (RLPLAT_PLUGIN_API), but this rlplat provides plugin API 1.3.0: "
                             "install a release of rlplat-future made for plugin API 1.3.0, or an rlplat whose plugin "
                             "API it admits")
    assert registry.entries_of_plugin("future") == []
    with pytest.raises(UnknownEntryError, match=r"Plugins that failed to load: future \(declares plugin API '>=2'"):
        registry.entry("reward_scorer", f"{module}_score")


def test_a_plugin_declaring_a_compatible_range_loads_and_its_range_is_recorded(write_dist):
    module = unique("current")
    write_dist("rlplat-current", "1.0.0", {"current": module}, scorer_plugin(module, ">=1.0,<2"))
    registry = Registry()
    assert (registry.plugin("current").status, registry.plugin("current").api) == ("ok", ">=1.0,<2")
    assert registry.entry("reward_scorer", f"{module}_score").plugin == "current"


def test_a_plugin_declaring_nothing_loads(write_dist):
    module = unique("quiet")
    write_dist("rlplat-quiet", "1.0.0", {"quiet": module}, scorer_plugin(module, None))
    registry = Registry()
    assert (registry.plugin("quiet").status, registry.plugin("quiet").api) == ("ok", None)


def test_a_declaration_that_is_not_a_range_fails_the_plugin_saying_how_to_write_one(write_dist):
    module = unique("garbled")
    write_dist("rlplat-garbled", "1.0.0", {"garbled": module}, scorer_plugin(module, "version one"))
    record = Registry().plugin("garbled")
    assert record.status == "failed"
    assert "RLPLAT_PLUGIN_API = 'version one' is not a version range" in record.reason
    assert "write PEP 440 specifiers such as '>=1.1,<2'" in record.reason


def test_a_plugin_object_registered_from_python_is_checked_too(isolated_registry):
    class Future:
        RLPLAT_PLUGIN_API = ">=2,<3"

        @rlplat.hookimpl
        def register_reward_scorers(self, register):
            register("future_score", "json:dumps")

    record = isolated_registry.register_plugin(Future(), name="future-object")
    assert record.status == "failed" and "declares plugin API '>=2,<3'" in record.reason
    assert isolated_registry.names("reward_scorer") == []


def test_plugins_list_shows_the_incompatible_plugin_as_failed_with_the_reason(write_dist, site, cli_run):
    module = unique("future_cli")
    write_dist("rlplat-future-cli", "3.0.0", {"future-cli": module}, scorer_plugin(module, ">=2"))
    listing = cli_run("plugins", "list", "--json", pythonpath=site)
    assert listing.returncode == 0, listing.stderr
    future = {p["plugin"]: p for p in json.loads(listing.stdout)}["future-cli"]
    assert (future["status"], future["plugin_api"], future["entries"]) == ("failed", ">=2", [])
    assert future["reason"].startswith("declares plugin API '>=2' (RLPLAT_PLUGIN_API), but this rlplat provides plugin API 1.3.0")
    info = cli_run("plugins", "info", "future-cli", pythonpath=site)
    assert "status:       failed: declares plugin API '>=2'" in info.stdout
    assert "plugin API:   declares >=2; rlplat provides 1.3.0" in info.stdout


def test_rlplats_own_implementations_provide_exactly_the_current_api():
    from rlplat.scorers import exact_match

    assert declared_api_of(exact_match) == f"=={PLUGIN_API_VERSION}"


def test_an_implementation_finds_the_range_its_plugins_entry_point_module_declares(write_dist):
    module = unique("found")
    write_dist("rlplat-found", "1.0.0", {"found": f"{module}.plugin"}, {
        f"{module}.__init__": "",
        f"{module}.plugin": "RLPLAT_PLUGIN_API = '>=1.0,<2'\n",
        f"{module}.losses": "def loss(*args):\n    pass\n",
    })
    import importlib

    assert declared_api_of(importlib.import_module(f"{module}.losses").loss) == ">=1.0,<2"
