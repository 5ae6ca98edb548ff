"""Meta-tests: every hook is documented, fills exactly one registry kind, and works through a plugin."""

from __future__ import annotations

import inspect

import pytest

from rlplat import hookimpl, hookspecs
from rlplat.plugins import HOOK_OF_KIND, KINDS

DESIGN_KINDS = (
    "engine", "rollout", "reward_manager", "reward_scorer", "advantage_estimator",
    "policy_loss", "algorithm", "dispatch_mode", "command", "role",
    # multi-turn rollouts (issue: agent loops with tools)
    "agent_loop", "tool", "tool_parser", "environment",
    # reward models and judges (issue: reward models, an LLM judge, an asynchronous reward loop)
    "judge_parser",
    # seams that keep optional features out of core (issue: a small core)
    "preset", "config_translator", "config_node", "rollout_driver",
    # the run parts that only watch a step (issue: the core is its contract)
    "step_observer",
)


def hook_functions():
    return {
        name: function
        for name, function in vars(hookspecs).items()
        if inspect.isfunction(function) and hasattr(function, "rlplat_spec")
    }


def test_the_kinds_are_the_ones_the_design_fixes():
    assert KINDS == DESIGN_KINDS


def test_every_hook_fills_exactly_one_kind_and_every_kind_has_a_hook():
    assert sorted(hook_functions()) == sorted(HOOK_OF_KIND.values())


@pytest.mark.parametrize("hook_name", sorted(HOOK_OF_KIND.values()))
def test_every_hook_takes_register_and_documents_its_kind_and_factory(hook_name):
    function = hook_functions()[hook_name]
    assert list(inspect.signature(function).parameters) == ["register"]
    doc = inspect.getdoc(function)
    kind = next(k for k, h in HOOK_OF_KIND.items() if h == hook_name)
    assert doc and f"``{kind}``" in doc
    assert "factory" in doc.lower()


def test_the_register_callback_is_documented_in_the_module():
    doc = hookspecs.__doc__
    for argument in ("name", "factory", "description", "requires", "install_hint", "config_schema", "metadata"):
        assert f"``{argument}``" in doc, argument


@pytest.mark.parametrize("kind", KINDS)
def test_a_plugin_implementing_the_hook_registers_an_entry_of_that_kind(kind, isolated_registry):
    hook_name = HOOK_OF_KIND[kind]

    def implementation(register):
        register(f"sample_{kind}", "json:dumps", description=f"a {kind}", metadata={"kind": kind})

    plugin = type("Plugin", (), {hook_name: staticmethod(hookimpl(implementation))})
    record = isolated_registry.register_plugin(plugin, name=f"plugin-{kind}")
    assert record.status == "ok", record.reason
    entry = isolated_registry.entry(kind, f"sample_{kind}")
    assert (entry.kind, entry.description, dict(entry.metadata)) == (kind, f"a {kind}", {"kind": kind})
    other_kinds = [k for k in KINDS if k != kind]
    assert all(isolated_registry.names(k) == [] for k in other_kinds)
