"""``rlplat --help``, ``--version``, ``plugins list``, ``plugins info`` and plugin commands."""

from __future__ import annotations

import json
from importlib.metadata import version


def acme_distribution(write_dist):
    write_dist("acme-rlplat", "1.4.0", {"acme": "acme_cli_plugin"}, {
        "acme_cli_plugin": """
            import rlplat

            @rlplat.hookimpl
            def register_reward_scorers(register):
                register("acme_exact", "json:dumps", description="exact match, the acme way")

            @rlplat.hookimpl
            def register_rollouts(register):
                register("acme_fast", "acme_cli_plugin:Rollout", requires=["no_such_acme_backend"],
                         install_hint="pip install acme-rlplat[fast]")

            @rlplat.hookimpl
            def register_commands(register):
                register("hello", "acme_cli_commands:hello", description="Say hello from acme.")
        """,
        "acme_cli_commands": """
            import typer

            def hello(name: str = typer.Option("world", help="Whom to greet.")):
                typer.echo(f"hello, {name}")
        """,
    })
    write_dist("broken-rlplat", "0.0.1", {"broken": "broken_cli_plugin"}, {
        "broken_cli_plugin": "import no_such_dependency_of_broken\n",
    })


def test_version_prints_the_installed_version(cli_run):
    result = cli_run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"rlplat {version('rlplat')}"


def test_help_lists_the_commands(cli_run):
    result = cli_run("--help")
    assert result.returncode == 0
    assert "plugins" in result.stdout


def test_plugins_list_shows_distribution_version_registrations_and_status(write_dist, site, cli_run):
    acme_distribution(write_dist)
    result = cli_run("plugins", "list", "--json", pythonpath=site)
    assert result.returncode == 0, result.stderr
    plugins = {p["plugin"]: p for p in json.loads(result.stdout)}
    acme = plugins["acme"]
    assert (acme["distribution"], acme["version"], acme["status"]) == ("acme-rlplat", "1.4.0", "ok")
    entries = {(e["kind"], e["name"]): e["status"] for e in acme["entries"]}
    assert entries[("reward_scorer", "acme_exact")] == "ok"
    assert entries[("rollout", "acme_fast")] == (
        "unavailable: no_such_acme_backend is not installed (pip install acme-rlplat[fast])"
    )
    assert plugins["broken"]["status"] == "failed"
    assert "no_such_dependency_of_broken" in plugins["broken"]["reason"]


def test_plugins_list_table_is_readable(write_dist, site, cli_run):
    acme_distribution(write_dist)
    result = cli_run("plugins", "list", pythonpath=site, env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    expected = ("acme-rlplat", "1.4.0", "reward_scorer: acme_exact", "rollout: acme_fast", "acme-rlplat[fast]", "failed")
    for text in expected:
        assert text in result.stdout, text


def test_plugins_info_by_plugin_distribution_or_entry_name(write_dist, site, cli_run):
    acme_distribution(write_dist)
    for name in ("acme", "acme-rlplat", "acme_exact"):
        result = cli_run("plugins", "info", name, pythonpath=site)
        assert result.returncode == 0, result.stderr
        assert "distribution: acme-rlplat 1.4.0" in result.stdout
        assert "exact match, the acme way" in result.stdout


def test_plugins_info_of_a_failed_plugin_shows_its_traceback(write_dist, site, cli_run):
    acme_distribution(write_dist)
    result = cli_run("plugins", "info", "broken", pythonpath=site)
    assert result.returncode == 0
    assert "status:       failed" in result.stdout
    assert "Traceback" in result.stdout and "no_such_dependency_of_broken" in result.stdout


def test_plugins_info_of_an_unknown_name_exits_2_with_a_suggestion(write_dist, site, cli_run):
    acme_distribution(write_dist)
    result = cli_run("plugins", "info", "acmee", pythonpath=site)
    assert result.returncode == 2
    assert "unknown plugin 'acmee'" in result.stderr and "Did you mean 'acme'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_plugin_can_add_a_command(write_dist, site, cli_run):
    acme_distribution(write_dist)
    help_text = cli_run("--help", pythonpath=site, env={"COLUMNS": "200"}).stdout
    assert "hello" in help_text and "Say hello from acme." in help_text
    result = cli_run("hello", "--name", "rlplat", pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello, rlplat"


def test_a_broken_command_plugin_is_reported_and_the_cli_still_works(write_dist, site, cli_run):
    write_dist("badcmd-rlplat", "0.1", {"badcmd": "badcmd_plugin"}, {
        "badcmd_plugin": """
            import rlplat

            @rlplat.hookimpl
            def register_commands(register):
                register("explode", "badcmd_plugin:not_there")
        """,
    })
    result = cli_run("plugins", "list", pythonpath=site)
    assert result.returncode == 0
    assert "command 'explode' from badcmd-rlplat 0.1 (plugin 'badcmd') is unusable" in result.stderr


def test_allow_list_and_kill_switch_reach_the_cli(write_dist, site, cli_run):
    acme_distribution(write_dist)
    only_acme = json.loads(cli_run("plugins", "list", "--json", pythonpath=site, env={"RLPLAT_PLUGINS": "acme"}).stdout)
    statuses = {p["plugin"]: p["status"] for p in only_acme}
    assert statuses["acme"] == "ok" and statuses["broken"] == "disabled"
    nothing = json.loads(cli_run("plugins", "list", "--json", pythonpath=site, env={"RLPLAT_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout)
    assert {p["plugin"] for p in nothing if p["status"] != "disabled"} == {"rlplat"}
