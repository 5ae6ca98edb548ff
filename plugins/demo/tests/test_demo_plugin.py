"""rlplat-demo as a plugin: its presets (what ``rlplat run --demo NAME`` finds through the registry) and the
tool demo's scorer are its registrations."""

from __future__ import annotations

import subprocess
import sys

import pytest

import rlplat_demo
from rlplat import presets, registry


def test_every_demo_is_a_registered_preset_implying_grpo_with_its_description():
    entries = {entry.name: entry for entry in registry.entries("preset") if entry.distribution == "rlplat-demo"}
    assert sorted(entries) == sorted(rlplat_demo.PRESETS)
    for name, entry in entries.items():
        assert entry.description == rlplat_demo.PRESETS[name]
        assert entry.metadata["algorithm"] == "grpo"
    assert [name for name, entry in entries.items() if entry.metadata.get("default")] == ["arith"]


@pytest.mark.parametrize("name", sorted(rlplat_demo.PRESETS))
def test_each_registered_factory_gives_the_demos_overrides(name):
    assert presets.overrides(name) == rlplat_demo.preset(name)


def test_arith_is_the_default_preset():
    assert presets.default_name() == "arith"
    assert presets.overrides("arith") == rlplat_demo.overrides()


def test_the_tool_demo_scorer_is_registered_by_the_demo():
    entry = registry.entry("reward_scorer", "tool_demo")
    assert entry.distribution == "rlplat-demo"
    assert entry.metadata["data_sources"] == ["arith_tools", "arith_chat"]
    assert entry.load()("arith_tools", "<tool_response>\n42\n</tool_response>42", "42") == {"score": 1.0, "acc": True}


def test_an_unknown_demo_names_the_registered_presets():
    from rlplat.config_node import ConfigError

    with pytest.raises(ConfigError) as raised:
        presets.overrides("tool")
    assert str(raised.value) == ("--demo tool: unknown preset; the registered presets are arith, distill, distill-rl, retry, retry-single, "
                                 "reward-model, tools, tools-blackbox. Did you mean 'tools'?")


