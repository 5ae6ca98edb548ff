"""The registry and plugin discovery, with fake distributions written to a directory on sys.path."""

from __future__ import annotations

import sys
import uuid

import pytest

from rlplat.registry import (
    DuplicateEntryError,
    EngineRegistry,
    EntryLoadError,
    Registry,
    RegistryError,
    UnavailableError,
    UnknownEntryError,
    UnknownKindError,
)


def unique(prefix: str) -> str:
    """Module names unique per test: imported modules stay in sys.modules for the whole session."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def scorer_plugin(module: str, names=("exact",), extra: str = "") -> dict[str, str]:
    registrations = "\n".join(
        f"    register({name!r}, '{module}_impl:score', description='scores {name}')" for name in names
    )
    return {
        module: f"import rlplat\n\n@rlplat.hookimpl\ndef register_reward_scorers(register):\n{registrations}\n{extra}",
        f"{module}_impl": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    }


def test_registration_records_name_kind_plugin_distribution_version_and_description(write_dist):
    module = unique("acme")
    write_dist("acme-rewards", "1.2.3", {"acme": module}, scorer_plugin(module))
    entry = Registry().entry("reward_scorer", "exact")
    assert (entry.kind, entry.name, entry.plugin) == ("reward_scorer", "exact", "acme")
    assert (entry.distribution, entry.version) == ("acme-rewards", "1.2.3")
    assert entry.description == "scores exact"
    assert entry.status == "ok"


def test_factories_are_imported_only_when_used(write_dist):
    module = unique("lazy")
    write_dist("lazy-rewards", "0.1", {"lazy": module}, scorer_plugin(module))
    registry = Registry()
    registry.entry("reward_scorer", "exact")
    assert f"{module}_impl" not in sys.modules
    scorer = registry.get("reward_scorer", "exact")
    assert f"{module}_impl" in sys.modules
    assert scorer("demo", "x", "x") == 1.0


def test_duplicate_name_raises_naming_both_distributions_and_leaves_other_names_usable(write_dist):
    first, second = unique("first"), unique("second")
    write_dist("first-dist", "1.0", {"first": first}, scorer_plugin(first, names=("exact", "only_first")))
    write_dist("second-dist", "2.0", {"second": second}, scorer_plugin(second))
    registry = Registry()
    with pytest.raises(DuplicateEntryError) as raised:
        registry.get("reward_scorer", "exact")
    assert "first-dist 1.0" in str(raised.value) and "second-dist 2.0" in str(raised.value)
    assert registry.get("reward_scorer", "only_first")("d", "a", "a") == 1.0
    assert "exact" in registry.names("reward_scorer")
    assert "exact" not in registry.names("reward_scorer", available_only=True)


def test_unknown_name_lists_the_available_names_and_the_closest_match(write_dist):
    module = unique("names")
    write_dist("names-dist", "1.0", {"names": module}, scorer_plugin(module, names=("gsm8k_strict", "math_boxed")))
    with pytest.raises(UnknownEntryError) as raised:
        Registry().get("reward_scorer", "gsm8k_strct")
    message = str(raised.value)
    assert "gsm8k_strict" in message and "math_boxed" in message
    assert "Did you mean 'gsm8k_strict'?" in message


def test_unknown_kind_names_the_kinds():
    with pytest.raises(UnknownKindError, match="Did you mean 'engine'"):
        Registry(environ={"RLPLAT_DISABLE_PLUGIN_AUTOLOAD": "1"}).names("engines")


def test_rlplat_registers_its_dispatch_modes_like_any_plugin_even_with_autoload_off():
    registry = Registry(environ={"RLPLAT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert registry.names("dispatch_mode") == ["ALL_TO_ALL", "DP_COMPUTE_PROTO", "DP_MESH", "ONE_TO_ALL", "RANK_ZERO"]
    entry = registry.entry("dispatch_mode", "DP_COMPUTE_PROTO")
    assert (entry.plugin, entry.distribution) == ("rlplat", "rlplat")


def test_missing_optional_dependency_makes_the_entry_unavailable_with_the_install_hint(write_dist):
    module = unique("optional")
    source = f"""
        import rlplat

        @rlplat.hookimpl
        def register_rollouts(register):
            register("fastgen", "{module}:Engine", requires=["no_such_package_xyz"],
                     install_hint="pip install fastgen-plugin[fastgen]")
    """
    write_dist("fastgen-plugin", "0.3", {"fastgen": module}, {module: source})
    registry = Registry()
    expected = "unavailable: no_such_package_xyz is not installed (pip install fastgen-plugin[fastgen])"
    assert registry.entry("rollout", "fastgen").status == expected
    with pytest.raises(UnavailableError, match=r"no_such_package_xyz is not installed \(pip install fastgen-plugin\[fastgen\]\)"):
        registry.get("rollout", "fastgen")
    assert EngineRegistry("rollout", registry).why_unavailable("fastgen") == expected


def test_plugin_that_raises_at_import_is_recorded_as_failed_and_the_others_still_work(write_dist):
    good, bad = unique("good"), unique("bad")
    write_dist("good-dist", "1.0", {"good": good}, scorer_plugin(good))
    write_dist("bad-dist", "1.0", {"bad": bad}, {bad: "raise RuntimeError('boom at import')\n"})
    registry = Registry()
    record = registry.plugin("bad")
    assert record.status == "failed"
    assert "RuntimeError: boom at import" in record.reason
    assert "boom at import" in record.traceback
    assert registry.get("reward_scorer", "exact")("d", "a", "a") == 1.0
    with pytest.raises(UnknownEntryError, match="bad .*boom at import"):
        registry.get("reward_scorer", "missing")


def test_plugin_whose_hook_raises_is_failed_and_keeps_nothing_it_registered(write_dist):
    module = unique("halfway")
    source = """
        import rlplat

        @rlplat.hookimpl
        def register_reward_scorers(register):
            register("registered_before_the_crash", "json:dumps")
            raise ValueError("config file not found")
    """
    write_dist("halfway-dist", "1.0", {"halfway": module}, {module: source})
    registry = Registry()
    assert registry.plugin("halfway").status == "failed"
    assert "ValueError: config file not found" in registry.plugin("halfway").reason
    assert "registered_before_the_crash" not in registry.names("reward_scorer")


def test_misspelled_hook_name_fails_the_plugin_loudly(write_dist):
    module = unique("typo")
    source = """
        import rlplat

        @rlplat.hookimpl
        def register_reward_scorer(register):
            register("never", "json:dumps")
    """
    write_dist("typo-dist", "1.0", {"typo": module}, {module: source})
    record = Registry().plugin("typo")
    assert record.status == "failed"
    assert "register_reward_scorer" in record.reason


def test_entry_point_to_a_missing_module_is_failed(write_dist):
    write_dist("ghost-dist", "1.0", {"ghost": unique("not_written")}, {})
    record = Registry().plugin("ghost")
    assert record.status == "failed" and "ModuleNotFoundError" in record.reason


def test_allow_list_loads_only_the_named_plugins_by_entry_point_or_distribution_name(write_dist):
    first, second, third = unique("one"), unique("two"), unique("three")
    write_dist("one-dist", "1.0", {"one": first}, scorer_plugin(first, names=("one",)))
    write_dist("two-dist", "1.0", {"two": second}, scorer_plugin(second, names=("two",)))
    write_dist("three-dist", "1.0", {"three": third}, scorer_plugin(third, names=("three",)))
    registry = Registry(environ={"RLPLAT_PLUGINS": "one, three-dist"})
    assert {"one", "three"} <= set(registry.names("reward_scorer"))
    assert "two" not in registry.names("reward_scorer")
    assert registry.plugin("two").status == "disabled"
    assert "RLPLAT_PLUGINS" in registry.plugin("two").reason
    assert second not in sys.modules


def test_disable_autoload_loads_no_entry_point(write_dist):
    module = unique("off")
    write_dist("off-dist", "1.0", {"off": module}, scorer_plugin(module))
    registry = Registry(environ={"RLPLAT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert registry.names("reward_scorer") == ["exact_match"]  # rlplat's own: the default
    assert {record.name for record in registry.plugins() if record.status != "disabled"} == {"rlplat"}
    assert module not in sys.modules


def test_plugins_registered_from_python_can_be_removed_and_resolve_conflicts(isolated_registry):
    from rlplat import hookimpl

    class First:
        @hookimpl
        def register_engines(self, register):
            register("tiny", "json:dumps")

    class Second:
        @hookimpl
        def register_engines(self, register):
            register("tiny", "json:loads")

    isolated_registry.register_plugin(First(), name="first")
    isolated_registry.register_plugin(Second(), name="second")
    with pytest.raises(DuplicateEntryError, match="plugin 'first'.*plugin 'second'"):
        isolated_registry.get("engine", "tiny")
    isolated_registry.unregister_plugin("first")
    import json

    assert isolated_registry.get("engine", "tiny") is json.loads
    with pytest.raises(RegistryError, match="already registered"):
        isolated_registry.register_plugin(Second(), name="second")


def test_engine_registry_builds_with_a_config_and_explains_unknown_names(isolated_registry):
    from rlplat import hookimpl

    class Engine:
        def __init__(self, config, world_size=1):
            self.config, self.world_size = config, world_size

    class Plugin:
        @hookimpl
        def register_engines(self, register):
            register("plain", Engine)

    isolated_registry.register_plugin(Plugin(), name="plain-engine")
    engines = EngineRegistry("engine", isolated_registry)
    built = engines.build("plain", {"lr": 1e-6}, world_size=2)
    assert (built.config, built.world_size) == ({"lr": 1e-6}, 2)
    assert engines.names() == ["plain"]
    assert engines.why_unavailable("plain") is None
    assert "unknown engine 'plian'" in engines.why_unavailable("plian")
    with pytest.raises(ValueError, match="'engine' or 'rollout'"):
        EngineRegistry("algorithm", isolated_registry)


def test_dotted_path_that_fails_to_import_names_the_entry_and_its_plugin(isolated_registry):
    from rlplat import hookimpl

    class Plugin:
        @hookimpl
        def register_policy_losses(self, register):
            register("broken", "no_such_module_abc:loss")

    isolated_registry.register_plugin(Plugin(), name="loss-plugin", distribution="loss-dist", version="0.9")
    with pytest.raises(EntryLoadError, match=r"policy_loss 'broken' from loss-dist 0.9 \(plugin 'loss-plugin'\)"):
        isolated_registry.get("policy_loss", "broken")


def test_needs_gpu_is_a_bool_or_a_function_asked_when_read(isolated_registry):
    from rlplat import hookimpl

    class Rollouts:
        @hookimpl
        def register_rollouts(self, register):
            register("fixed", "json:dumps", metadata={"needs_gpu": True})
            register("asks", "json:dumps", metadata={"needs_gpu": "os.path:isabs"})  # a function of no argument raises
            register("answers", "json:dumps", metadata={"needs_gpu": "builtins:bool"})  # bool() is False
            register("plain", "json:dumps")

    isolated_registry.register_plugin(Rollouts(), name="rollouts")
    assert isolated_registry.entry("rollout", "fixed").needs_gpu is True
    assert isolated_registry.entry("rollout", "answers").needs_gpu is False
    assert isolated_registry.entry("rollout", "plain").needs_gpu is False
    with pytest.raises(EntryLoadError, match=r"rollout 'asks' .*needs_gpu='os.path:isabs' could not be answered"):
        isolated_registry.entry("rollout", "asks").needs_gpu
