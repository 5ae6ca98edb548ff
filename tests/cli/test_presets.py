"""A preset (kind ``preset``): the settings ``--demo NAME`` puts before the user's overrides, or the default
preset's when no model or config is given. Core registers none; these tests register their own."""

from __future__ import annotations

import pytest

from rlplat import hookimpl, presets
from rlplat.cli.command_line import with_preset
from rlplat.config_node import ConfigError


class Presets:
    @hookimpl
    def register_presets(self, register):
        register("tiny", lambda: ["trainer.seed=7"], description="a tiny preset", metadata={"algorithm": "ppo"})
        register("broken", lambda: "trainer.seed=7", description="not a list")


def test_a_preset_goes_before_the_users_overrides_and_names_its_algorithm(register_temporary_plugin, capsys):
    register_temporary_plugin(Presets(), name="test-presets")
    assert with_preset("tiny", ["trainer.seed=8"], None, "note") == (["trainer.seed=7", "trainer.seed=8"], "ppo")
    assert "rlplat: the tiny preset (ppo): a tiny preset" in capsys.readouterr().err
    assert with_preset("tiny", [], "grpo", "note")[1] == "grpo"  # --algo wins


def test_a_preset_that_returns_no_list_is_refused(register_temporary_plugin):
    register_temporary_plugin(Presets(), name="test-presets")
    with pytest.raises(ConfigError, match="preset 'broken' from .* returned str, not a list of key=value strings"):
        presets.overrides("broken")


def test_two_default_presets_are_refused_naming_both(register_temporary_plugin):
    class SecondDefault:
        @hookimpl
        def register_presets(self, register):
            register("other", lambda: [], metadata={"default": True})
            register("another", lambda: [], metadata={"default": True})

    register_temporary_plugin(SecondDefault(), name="second-default")
    with pytest.raises(ConfigError, match="several presets are marked as the default: 'another' .*, 'other'"):
        presets.default_name()


@pytest.mark.slow
def test_without_a_preset_plugin_a_run_without_model_says_what_to_pass(cli_run):
    result = cli_run("config", "show", env={"RLPLAT_PLUGINS": "engine-fsdp2,rollout-hf,algorithms,rewards"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "rlplat: config error: no model.path or --config given, and no installed plugin registers a default preset: "
        "pass model.path=/path/to/hf_model (or --config FILE), or pip install rlplat-demo for the built-in demo")
    unknown = cli_run("config", "show", "--demo", "arith", env={"RLPLAT_PLUGINS": "engine-fsdp2"})
    assert "--demo arith: no preset is registered; pip install rlplat-demo" in unknown.stderr
