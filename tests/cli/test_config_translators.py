"""Config translators (kind ``config_translator``): readers of another framework's keys that ``rlplat run``,
``plan`` and ``config`` apply to the command line before ``load_config``, every registered one in name
order, each on the previous one's output. Core registers none (rlplat-verl registers ``verl``); these
tests register their own."""

from __future__ import annotations

import pytest
import typer

from rlplat import hookimpl
from rlplat.cli.command_line import translated
from rlplat.config_node import ConfigError


class Translators:
    """Two translators whose order shows: ``b_upper`` upper-cases values ``a_rename`` has renamed."""

    @hookimpl
    def register_config_translators(self, register):
        def rename(config_path, arguments, *, algo, rollout):
            return config_path, [argument.replace("old.", "new.") for argument in arguments], [f"renamed for {algo}"]

        def upper(config_path, arguments, *, algo, rollout):
            if "refuse=me" in arguments:
                raise ConfigError("refuse=me: no equivalent")
            return "other.yaml", [argument.upper() if argument.startswith("new.") else argument for argument in arguments], []

        register("b_upper", upper)
        register("a_rename", rename)


def test_translators_run_in_name_order_each_on_the_previous_output(register_temporary_plugin, capsys):
    register_temporary_plugin(Translators(), name="translators")
    config, arguments = translated(None, ["old.key=value", "kept=1"], algo="grpo", rollout=None)
    assert (config, arguments) == ("other.yaml", ["NEW.KEY=VALUE", "kept=1"])
    assert "rlplat: renamed for grpo" in capsys.readouterr().err


def test_a_translators_refusal_is_a_config_error_with_exit_code_2(register_temporary_plugin, capsys):
    register_temporary_plugin(Translators(), name="translators")
    with pytest.raises(typer.Exit) as exited:
        translated(None, ["refuse=me"], algo=None, rollout=None)
    assert exited.value.exit_code == 2
    assert "rlplat: config error: refuse=me: no equivalent" in capsys.readouterr().err
