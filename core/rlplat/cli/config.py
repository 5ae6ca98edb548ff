"""``rlplat config show`` and ``rlplat config explain``: the resolved config a run would use, validated
as a run would, and what each of its keys means."""

from __future__ import annotations

from typing import List, Optional

import typer

from rlplat.cli.command_line import ALGO, CONFIG, DEMO, ENGINE, ROLLOUT, RunArguments, resolved_config, run_options

app = typer.Typer(help="Inspect the resolved run config and what its keys mean.", no_args_is_help=True)


@app.command("show")
@run_options
def show(
    arguments: RunArguments,
    no_validate: bool = typer.Option(False, "--no-validate", help="Print without checking paths and plugins."),
    doc: bool = typer.Option(False, "--doc", help="Print every key with its type, default, owner and description instead."),
) -> None:
    """Print the resolved config as YAML (with no model or config: the built-in demo's, as `rlplat run`
    uses it); a config error is printed in one paragraph (exit code 2)."""
    from rlplat.config import to_yaml

    resolved = arguments.resolved(validate=not no_validate or doc)
    if doc:
        from rlplat.cli.explain import explain, render

        typer.echo(render(explain(resolved)))
        return
    typer.echo(to_yaml(resolved), nl=False)


@app.command("explain")
def explain_keys(
    key: Optional[str] = typer.Argument(None, help="A key or node, e.g. actor.optim.lr or actor.engine_config (default: every key)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides that choose plugins, e.g. rollout.name=hf."),
    algo: Optional[str] = ALGO,
    engine: Optional[str] = ENGINE,
    rollout: Optional[str] = ROLLOUT,
    config: Optional[str] = CONFIG,
    demo: Optional[str] = DEMO,
) -> None:
    """Print a key (or every key under a node) with its type, default, value in this config, owner (core
    or the plugin that declares it) and description; the chosen plugins decide what their nodes hold."""
    from rlplat.cli.explain import explain, render

    if key is not None and "=" in key:  # only overrides were given
        overrides, key = [key, *(overrides or [])], None
    resolved = resolved_config(config, overrides, algo=algo, engine=engine, rollout=rollout, demo=demo)
    keys = explain(resolved)
    text = render(keys, key)
    if not text:
        from rlplat.config_node import did_you_mean

        typer.echo(f"rlplat: no config key {key!r}.{did_you_mean(key, [doc.key for doc in keys])}", err=True)
        raise typer.Exit(2)
    typer.echo(text)
