"""``rlplat``: assembles the built-in commands and the commands plugins register (kind ``command``)."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from rlplat.cli import config as config_command
from rlplat.cli import plot as plot_command
from rlplat.cli import plugins as plugins_command
from rlplat.cli import run as run_command

HELP = "rlplat: reinforcement-learning post-training of language models (PPO, GRPO and their family)."


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlplat {version('rlplat')}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def root(
        version: Optional[bool] = typer.Option(
            None, "--version", callback=print_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """rlplat: reinforcement-learning post-training of language models."""

    app.add_typer(plugins_command.app, name="plugins")
    app.add_typer(config_command.app, name="config")
    app.command("run", help=run_command.help_text())(run_command.run)
    app.command("plot")(plot_command.plot)
    add_plugin_commands(app)
    return app


def add_plugin_commands(app: typer.Typer) -> None:
    """Mount every registered ``command`` entry; one that fails to load is reported, not fatal."""
    from rlplat import registry

    built_in = {"plugins", "config", "run", "plot"}
    for entry in registry.entries("command"):
        if entry.name in built_in:
            typer.echo(f"rlplat: ignoring command {entry.name!r} from {entry.origin}: the name is built in", err=True)
            continue
        try:
            command = entry.load()
            if isinstance(command, typer.Typer):
                app.add_typer(command, name=entry.name, help=entry.description or None)
            elif callable(command):
                app.command(name=entry.name, help=entry.description or None)(command)
            else:
                raise TypeError(f"expected a typer.Typer or a function, got {type(command).__name__}")
        except Exception as error:  # one broken plugin must not take the CLI down
            typer.echo(f"rlplat: command {entry.name!r} from {entry.origin} is unusable: {error}", err=True)


def main(argv: Optional[list[str]] = None) -> None:
    app = build_app()
    app(args=argv if argv is not None else sys.argv[1:], prog_name="rlplat")


if __name__ == "__main__":
    main()
