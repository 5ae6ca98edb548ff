"""``rlplat``: mounts every registered command (kind ``command``): rlplat's own (``run``, ``config``,
``plugins``, ``plot``, registered by rlplat through ``register_commands`` like any plugin's) and those
plugins add."""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer

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

    for entry in command_entries():
        mount(app, entry)
    return app


def command_entries() -> list[Any]:
    """Every usable command entry, rlplat's own first. A name two plugins claim goes to rlplat's entry
    when one of them is rlplat's (the other is reported), and to neither otherwise."""
    from rlplat import registry

    entries = registry.entries("command")
    for (kind, name), claimants in registry.conflicts().items():
        if kind != "command":
            continue
        own = [entry for entry in claimants if entry.plugin == "rlplat"]
        others = ", ".join(entry.origin for entry in claimants if entry.plugin != "rlplat")
        if own:
            typer.echo(f"rlplat: ignoring command {name!r} from {others}: the name is rlplat's own", err=True)
            entries.append(own[0])
        else:
            typer.echo(f"rlplat: command {name!r} is registered by {others}; neither is mounted", err=True)
    return sorted(entries, key=lambda entry: entry.plugin != "rlplat")


def mount(app: typer.Typer, entry: Any) -> None:
    """Mount one command entry; one that fails to load is reported, not fatal."""
    try:
        command = entry.load()
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=entry.name, help=entry.description or None)
        elif callable(command):
            help_text = getattr(command, "help_text", None)
            app.command(name=entry.name, help=help_text() if callable(help_text) else entry.description or None)(command)
        else:
            raise TypeError(f"expected a typer.Typer or a function, got {type(command).__name__}")
    except Exception as error:  # one broken plugin must not take the CLI down
        typer.echo(f"rlplat: command {entry.name!r} from {entry.origin} is unusable: {error}", err=True)


def main(argv: Optional[list[str]] = None) -> None:
    app = build_app()
    app(args=argv if argv is not None else sys.argv[1:], prog_name="rlplat")


if __name__ == "__main__":
    main()
