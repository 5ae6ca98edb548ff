"""What ``rlplat run``, ``rlplat config show`` and ``rlplat config explain`` share: the run's arguments,
read the same way (every registered config translator applied, with a note per translated key; a preset
when ``--demo NAME`` is given, or the default preset when no model or config is; validation), and a
config error printed in one paragraph with exit code 2."""

from __future__ import annotations

from typing import List, Optional

import typer

OVERRIDES = typer.Argument(None, help="Dotted overrides, e.g. actor.optim.lr=1e-6 trainer.total_training_steps=100.")
ALGO = typer.Option(None, "--algo", help="Algorithm (kind 'algorithm').")
ENGINE = typer.Option(None, "--engine", help="Training engine (kind 'engine').")
ROLLOUT = typer.Option(None, "--rollout", help="Rollout engine (kind 'rollout').")
CONFIG = typer.Option(None, "--config", help="YAML file merged over the defaults.")
DEMO = typer.Option(None, "--demo", help="A registered preset (kind 'preset', see rlplat plugins list), put before "
                    "your overrides; without model.path or --config the default preset runs (rlplat-demo's arith).")


def fail(message: str) -> typer.Exit:
    typer.echo(f"rlplat: config error: {message}", err=True)
    return typer.Exit(2)


def translated(config: Optional[str], arguments: List[str], *, algo: Optional[str],
               rollout: Optional[str]) -> tuple[Optional[str], List[str]]:
    """``(config, arguments)`` after every registered config translator (kind ``config_translator``, in name
    order, each on the previous one's output), their notes printed; ``typer.Exit(2)`` on a refusal."""
    from rlplat import registry
    from rlplat.config_node import ConfigError
    from rlplat.registry import RegistryError

    for entry in registry.entries("config_translator"):
        try:
            config, arguments, notes = entry.load()(config, arguments, algo=algo, rollout=rollout)
        except ConfigError as error:
            raise fail(str(error)) from None
        except RegistryError as error:
            raise fail(f"the config translator {entry.name!r} cannot run: {error}") from None
        for note in notes:
            typer.echo(f"rlplat: {note}", err=True)
    return config, list(arguments)


def with_preset(name: Optional[str], arguments: List[str], algo: Optional[str],
                demo_note: str) -> tuple[List[str], Optional[str]]:
    """``(arguments, algo)`` with preset ``name`` (None: the default preset) put first; ``typer.Exit(2)``
    when there is no such preset or it cannot be read."""
    from rlplat import presets
    from rlplat.config_node import ConfigError
    from rlplat.registry import RegistryError

    try:
        chosen = name or presets.default_name()
        if chosen is None:
            raise fail("no model.path or --config given, and no installed plugin registers a default preset: pass "
                       "model.path=/path/to/hf_model (or --config FILE), or "
                       f"{presets.INSTALL_HINT} for the built-in demo")
        settings = presets.overrides(chosen)
        algo = algo or presets.algorithm(chosen)
        description = presets.entry(chosen).description
    except ConfigError as error:
        raise fail(str(error)) from None
    except (ImportError, FileNotFoundError, RegistryError) as error:
        typer.echo(f"rlplat: the preset {chosen!r} is not available: {error}", err=True)
        raise typer.Exit(2) from None
    if name is None:
        typer.echo(f"rlplat: no model.path or --config given: {demo_note} ({algo or 'the default algorithm'}, "
                   f"preset {chosen})", err=True)
    else:
        typer.echo(f"rlplat: the {chosen} preset{f' ({algo})' if algo else ''}: {description}", err=True)
    return settings + arguments, algo


def resolved_config(config: Optional[str], overrides: Optional[List[str]], *, algo: Optional[str], engine: Optional[str],
                    rollout: Optional[str], validate: bool = True, demo_note: str = "using the built-in demo's settings",
                    demo: Optional[str] = None):
    """The run config these arguments describe (see the module docstring); raises ``typer.Exit(2)`` on a
    config error."""
    from rlplat.config import ConfigError, load_config

    config, arguments = translated(config, list(overrides or []), algo=algo, rollout=rollout)
    if demo is not None or (config is None and not any(argument.startswith(("model.path=", "data.train_files="))
                                                       for argument in arguments)):
        arguments, algo = with_preset(demo, arguments, algo, demo_note)
    try:
        return load_config(config, arguments, algo=algo, engine=engine, rollout=rollout, validate=validate)
    except ConfigError as error:
        raise fail(str(error)) from None
