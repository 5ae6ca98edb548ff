"""What ``rlplat run``, ``rlplat plan``, ``rlplat config show`` and ``rlplat config explain`` share: the
run's arguments, declared once (:func:`run_options`) and read the same way (every registered config
translator applied, with a note per translated key; a preset when ``--demo NAME`` is given, or the default
preset when no model or config is; validation), and a config error printed in one paragraph with exit
code 2."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, List, Optional

import typer

OVERRIDES = typer.Argument(None, help="Dotted overrides, e.g. actor.optim.lr=1e-6 trainer.total_training_steps=100.")
ALGO = typer.Option(None, "--algo", help="Algorithm (kind 'algorithm').")
ENGINE = typer.Option(None, "--engine", help="Training engine (kind 'engine').")
ROLLOUT = typer.Option(None, "--rollout", help="Rollout engine (kind 'rollout').")
CONFIG = typer.Option(None, "--config", help="YAML file merged over the defaults.")
DEMO = typer.Option(None, "--demo", help="A registered preset (kind 'preset', see rlplat plugins list), put before "
                    "your overrides; without model.path or --config the default preset runs (rlplat-demo's arith).")


@dataclasses.dataclass(frozen=True)
class RunArguments:
    """The options a command that reads a run takes first (:func:`run_options`), as given."""

    overrides: Optional[List[str]]
    algo: Optional[str]
    engine: Optional[str]
    rollout: Optional[str]
    config: Optional[str]
    demo: Optional[str]

    def resolved(self, *, validate: bool = True, demo_note: str = "using the built-in demo's settings"):
        """The run config they describe (:func:`resolved_config`)."""
        return resolved_config(self.config, self.overrides, algo=self.algo, engine=self.engine, rollout=self.rollout,
                               validate=validate, demo_note=demo_note, demo=self.demo)


RUN_OPTIONS = {"overrides": OVERRIDES, "algo": ALGO, "engine": ENGINE, "rollout": ROLLOUT, "config": CONFIG, "demo": DEMO}
"""The typer declaration of each field of :class:`RunArguments`, in the order ``--help`` lists them."""


def run_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command(arguments: RunArguments, <its own parameters>)`` as the typer command whose parameters are the
    run options (:data:`RUN_OPTIONS`), then its own: what ``rlplat run``, ``rlplat plan`` and ``rlplat
    config show`` read a run from is declared here once. typer reads the parameters from the signature
    this gives the command."""
    hints = typing.get_type_hints(RunArguments)
    shared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=declaration,
                                annotation=hints[name]) for name, declaration in RUN_OPTIONS.items()]
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]

    @functools.wraps(command)
    def with_run_options(**options: Any) -> Any:
        arguments = RunArguments(**{name: options.pop(name) for name in RUN_OPTIONS})
        return command(arguments, **options)

    with_run_options.__signature__ = inspect.Signature(shared + own, return_annotation=None)
    with_run_options.__annotations__ = {parameter.name: parameter.annotation for parameter in shared + own}
    return with_run_options


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
