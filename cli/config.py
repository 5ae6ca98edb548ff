"""``rlplat config show``: the resolved config a run would use, validated as a run would."""

from __future__ import annotations

from typing import List, Optional

import typer

app = typer.Typer(help="Inspect the resolved run config.", no_args_is_help=True)


@app.command("show")
def show(
    overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides, e.g. actor.optim.lr=1e-6."),
    algo: Optional[str] = typer.Option(None, "--algo", help="Registered algorithm (kind 'algorithm')."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Registered training engine (kind 'engine')."),
    rollout: Optional[str] = typer.Option(None, "--rollout", help="Registered rollout engine (kind 'rollout')."),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file merged over the defaults."),
    no_validate: bool = typer.Option(False, "--no-validate", help="Print without checking paths and plugins."),
) -> None:
    """Print the resolved config as YAML; a config error is printed in one paragraph (exit code 2)."""
    from rlplat.config import ConfigError, load_config, to_yaml
    from rlplat.verl_keys import translate_command_line

    try:
        config, arguments, notes = translate_command_line(config, overrides or [], algo=algo, rollout=rollout)
        for note in notes:  # verl's keys become rlplat's, one note each
            typer.echo(f"rlplat: {note}", err=True)
        resolved = load_config(config, arguments, algo=algo, engine=engine, rollout=rollout, validate=not no_validate)
    except ConfigError as error:
        typer.echo(f"rlplat: config error: {error}", err=True)
        raise typer.Exit(2)
    typer.echo(to_yaml(resolved), nl=False)
