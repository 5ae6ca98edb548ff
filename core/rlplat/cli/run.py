"""``rlplat run``: train. With no arguments, the built-in demo (GRPO on an arithmetic task)."""

from __future__ import annotations

import typer

from rlplat.cli.command_line import RunArguments, fail, run_options

DEMO_HELP = (
    "Without model.path or --config it trains the default preset: with rlplat-demo installed, the built-in demo "
    "(GRPO with the fsdp2 engine on 2 CPU processes and the hf rollout, on a tiny arithmetic model shipped with "
    "rlplat-demo; other overrides apply on top)."
)


def installed(kind: str) -> str:
    from rlplat import registry

    names = registry.names(kind)
    usable = [name for name in names if registry.entry(kind, name).status == "ok"]
    unusable = [name for name in names if name not in usable]
    text = ", ".join(usable) or "none"
    return f"{text} (unavailable here: {', '.join(unusable)}; see rlplat plugins list)" if unusable else text


@run_options
def run(arguments: RunArguments) -> None:
    """Train with the chosen algorithm, engine and rollout; the run directory holds the resolved config,
    metrics (JSONL, TensorBoard) and checkpoints."""
    resolved = arguments.resolved(demo_note="training the built-in demo")
    check_memory(resolved)
    from rlplat.config import ConfigError, check_before_start

    try:  # this machine and the run directory; after the plan, which may be made for another machine
        check_before_start(resolved)
    except ConfigError as error:
        raise fail(str(error)) from None
    from rlplat.trainer import Trainer

    typer.echo(f"rlplat: run directory {resolved.trainer.output_dir}", err=True)
    trainer = Trainer(resolved)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    typer.echo(f"rlplat: done; metrics in {resolved.trainer.output_dir}/metrics.jsonl, plot them with "
               f"`rlplat plot {resolved.trainer.output_dir}`", err=True)


def check_memory(resolved) -> None:
    """The memory plan (``rlplat plan``) of the validated config: a run whose predicted peak exceeds a
    device's memory is refused with the phase, the component and the numbers (exit 2), unless
    ``cluster.memory_check`` is ``warn`` or ``skip``."""
    mode = resolved.cluster.memory_check
    if mode == "skip":
        return
    from rlplat.cli.plan import make_plan
    from rlplat.kits.memory import human_bytes

    plan = make_plan(resolved)
    problems = plan.problems()
    if not problems:
        phase, total, _ = max((plan.peak(pool.name) for pool in plan.pools), key=lambda peak: peak[1])
        memory = (f"of {human_bytes(plan.device_memory)}" if plan.device_memory is not None
                  else f"(not checked: {plan.device_memory_source})")
        typer.echo(f"rlplat: memory plan: peak {human_bytes(total)} per device in {phase} {memory}; `rlplat plan` "
                   "shows the parts", err=True)
        return
    text = "\n".join(f"  - {problem}" for problem in problems)
    if mode == "warn":
        typer.echo(f"rlplat: warning: the memory plan does not fit (cluster.memory_check=warn, running anyway):\n{text}", err=True)
        return
    typer.echo(f"rlplat: the run would run out of memory, refused before anything starts:\n{text}\n"
               "`rlplat plan` with the same arguments shows every part; lower what the largest part depends on, "
               "or set cluster.memory_check=warn (cluster.device_memory_gib if the device size is wrong).", err=True)
    raise typer.Exit(2)


def help_text() -> str:
    from rlplat import presets

    return (
        f"Train a policy. {DEMO_HELP}\n\nInstalled algorithms: {installed('algorithm')}. "
        f"Engines: {installed('engine')}. Rollouts: {installed('rollout')}. Presets (--demo): {presets.describe()}."
    )


run.help_text = help_text  # the CLI reads the help of this command when it mounts it (lists what is installed)
