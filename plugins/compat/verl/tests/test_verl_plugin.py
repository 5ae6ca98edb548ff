"""rlplat-verl as a plugin: it registers the ``verl`` config translator that every run's command line goes
through, and without it a verl key is an unknown key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlplat_verl.translate import translate_command_line


def test_the_plugin_registers_the_verl_config_translator():
    from rlplat import registry

    entry = registry.entry("config_translator", "verl")
    assert entry.distribution == "rlplat-verl"
    assert entry.load() is translate_command_line


def test_the_translator_takes_and_returns_what_the_hook_says():
    config, arguments, notes = translate_command_line(None, ["actor_rollout_ref.rollout.n=4", "trainer.seed=1"],
                                                      algo=None, rollout=None)
    assert (config, arguments) == (None, ["rollout.n=4", "trainer.seed=1"])
    assert notes == ["verl key actor_rollout_ref.rollout.n -> rollout.n"]


def test_rlplat_config_show_translates_through_the_registered_translator(cli_in_process):
    result = cli_in_process("config", "show", "actor_rollout_ref.actor.optim.lr=3e-6")
    assert result.returncode == 0, result.stderr
    assert "rlplat: verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in result.stderr
    assert "lr: 3.0e-06" in result.stdout


@pytest.mark.slow
def test_without_the_plugin_a_verl_key_is_an_unknown_key(cli_run):
    enabled = "engine-fsdp2,rollout-hf,algorithms,rewards,demo"
    result = cli_run("config", "show", "actor_rollout_ref.actor.optim.lr=3e-6", env={"RLPLAT_PLUGINS": enabled})
    assert result.returncode == 2
    assert "verl key" not in result.stderr
    assert "unknown config key 'actor_rollout_ref'" in result.stderr


def test_the_agent_names_it_reads_are_the_agent_loops_own():
    agent_config = pytest.importorskip("rlplat_agents.config")
    from rlplat_verl.rules import VERL_LOOP_NAMES

    assert VERL_LOOP_NAMES == agent_config.VERL_LOOP_NAMES

