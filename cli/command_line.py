"""What ``rlplat run``, ``rlplat config show`` and ``rlplat config explain`` share: the run's arguments,
read the same way (verl's keys translated with a note each, the built-in demo's preset when no model or
config is given, validation), and a config error printed in one paragraph with exit code 2."""

from __future__ import annotations

from typing import List, Optional

import typer

OVERRIDES = typer.Argument(None, help="Dotted overrides, e.g. actor.optim.lr=1e-6 trainer.total_training_steps=100.")
ALGO = typer.Option(None, "--algo", help="Algorithm (kind 'algorithm').")
ENGINE = typer.Option(None, "--engine", help="Training engine (kind 'engine').")
ROLLOUT = typer.Option(None, "--rollout", help="Rollout engine (kind 'rollout').")
CONFIG = typer.Option(None, "--config", help="YAML file merged over the defaults.")
DEMO = typer.Option(None, "--demo", help="A built-in demo's preset: arith (the default without model.path or "
                    "--config), tools (GRPO learns to call a calculator), retry (up to 3 attempts with feedback), "
                    "retry-single (the same task, one attempt).")


def fail(message: str) -> typer.Exit:
    typer.echo(f"rlplat: config error: {message}", err=True)
    return typer.Exit(2)


def resolved_config(config: Optional[str], overrides: Optional[List[str]], *, algo: Optional[str], engine: Optional[str],
                    rollout: Optional[str], validate: bool = True, demo_note: str = "using the built-in demo's settings",
                    demo: Optional[str] = None):
    """The run config these arguments describe (see the module docstring); raises ``typer.Exit(2)`` on a
    config error."""
    from rlplat.config import ConfigError, load_config
    from rlplat.verl_keys import translate_command_line

    try:  # verl's keys (actor_rollout_ref.actor.optim.lr=...) become rlplat's, one note each
        config, arguments, notes = translate_command_line(config, list(overrides or []), algo=algo, rollout=rollout)
    except ConfigError as error:
        raise fail(str(error)) from None
    for note in notes:
        typer.echo(f"rlplat: {note}", err=True)
    if demo is not None or (config is None and not any(argument.startswith(("model.path=", "data.train_files="))
                                                       for argument in arguments)):
        from rlplat.demo import PRESETS, preset

        if demo is not None and demo not in PRESETS:
            raise fail(f"--demo: unknown demo {demo!r}; the demos are {', '.join(PRESETS)}")
        try:
            arguments = preset(demo or "arith") + arguments
        except (ImportError, FileNotFoundError) as error:
            typer.echo(f"rlplat: the built-in demo is not available: {error}", err=True)
            raise typer.Exit(2) from None
        algo = algo or "grpo"
        if demo is None:
            typer.echo(f"rlplat: no model.path or --config given: {demo_note} ({algo}, arithmetic)", err=True)
        else:
            typer.echo(f"rlplat: the {demo} demo ({algo}): {PRESETS[demo]}", err=True)
    try:
        return load_config(config, arguments, algo=algo, engine=engine, rollout=rollout, validate=validate)
    except ConfigError as error:
        raise fail(str(error)) from None
