"""``rlplat run``: train. With no arguments, the built-in demo (GRPO on an arithmetic task)."""

from __future__ import annotations

from typing import List, Optional

import typer

DEMO_HELP = (
    "Without model.path or --config it trains the built-in demo: GRPO with the fsdp2 engine on 2 CPU "
    "processes and the hf rollout, on a tiny arithmetic model shipped with rlplat (other overrides apply on top)."
)


def installed(kind: str) -> str:
    from rlplat import registry

    names = registry.names(kind)
    usable = [name for name in names if registry.entry(kind, name).status == "ok"]
    unusable = [name for name in names if name not in usable]
    text = ", ".join(usable) or "none"
    return f"{text} (unavailable here: {', '.join(unusable)}; see rlplat plugins list)" if unusable else text


def demo_overrides() -> list[str]:
    """The demo's settings (measured in DEMO_NOTES.md); the user's own overrides come after them."""
    from pathlib import Path

    from rlplat import demo
    from rlplat.demo import scorer

    return [
        f"model.path={demo.model_dir()}",
        f"data.train_files=[{demo.train_file()}]",
        f"data.val_files=[{demo.val_file()}]",
        f"reward.custom_function.path={Path(scorer.__file__)}",
        "reward.custom_function.name=exact_match",
        "data.train_batch_size=32", "data.max_prompt_length=16",
        "rollout.n=8", "rollout.response_length=4", "rollout.temperature=1.0",
        "actor.optim.lr=1e-4", "actor.ppo_mini_batch_size=32", "actor.micro_batch_size_per_gpu=256",
        "actor.optim.weight_decay=0.0", "actor.loss.use_kl_loss=false", "actor.loss.loss_agg_mode=token-mean",
        "trainer.total_training_steps=150", "trainer.test_freq=10", "trainer.save_freq=50",
        "trainer.output_dir=runs/demo", "cluster.devices_per_node=2",
    ]


def run(
    overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides, e.g. actor.optim.lr=1e-6 trainer.total_training_steps=100."),
    algo: Optional[str] = typer.Option(None, "--algo", help="Algorithm (kind 'algorithm')."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Training engine (kind 'engine')."),
    rollout: Optional[str] = typer.Option(None, "--rollout", help="Rollout engine (kind 'rollout')."),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file merged over the defaults."),
) -> None:
    """Train with the chosen algorithm, engine and rollout; the run directory holds the resolved config,
    metrics (JSONL, TensorBoard) and checkpoints."""
    from rlplat.config import ConfigError, load_config
    from rlplat.verl_keys import translate_command_line

    try:  # verl's keys (actor_rollout_ref.actor.optim.lr=...) become rlplat's, one note each
        config, arguments, notes = translate_command_line(config, list(overrides or []), algo=algo, rollout=rollout)
    except ConfigError as error:
        typer.echo(f"rlplat: config error: {error}", err=True)
        raise typer.Exit(2)
    for note in notes:
        typer.echo(f"rlplat: {note}", err=True)
    if config is None and not any(a.startswith(("model.path=", "data.train_files=")) for a in arguments):
        try:
            arguments = demo_overrides() + arguments
        except (ImportError, FileNotFoundError) as error:
            typer.echo(f"rlplat: the built-in demo is not available: {error}", err=True)
            raise typer.Exit(2)
        algo = algo or "grpo"
        typer.echo(f"rlplat: no model.path or --config given: training the built-in demo ({algo}, arithmetic)", err=True)
    try:
        resolved = load_config(config, arguments, algo=algo, engine=engine, rollout=rollout)
    except ConfigError as error:
        typer.echo(f"rlplat: config error: {error}", err=True)
        raise typer.Exit(2)
    from rlplat.trainer import Trainer

    typer.echo(f"rlplat: run directory {resolved.trainer.output_dir}", err=True)
    trainer = Trainer(resolved)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    typer.echo(f"rlplat: done; metrics in {resolved.trainer.output_dir}/metrics.jsonl, plot them with "
               f"`rlplat plot {resolved.trainer.output_dir}`", err=True)


def help_text() -> str:
    return (
        f"Train a policy. {DEMO_HELP}\n\nInstalled algorithms: {installed('algorithm')}. "
        f"Engines: {installed('engine')}. Rollouts: {installed('rollout')}."
    )
