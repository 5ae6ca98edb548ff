"""``rlplat plan [same arguments as run] [--json]``: the run's memory and placement, predicted per device
and per phase from the config and the models' ``config.json`` (no weights, no worker, no cluster).

Exit 0 when the plan fits or the device memory is unknown, 1 when it does not fit, 2 on a config error.
"""

from __future__ import annotations

import typer

from rlplat.cli.command_line import RunArguments, fail, run_options

JSON = typer.Option(False, "--json", help="Print the plan as JSON (bytes per item and per phase, the peak, problems).")


def make_plan(resolved):
    """The plan of a resolved config; a config error (exit 2) when it cannot be made."""
    from rlplat.cli.planner import PlanError, plan_run

    try:
        return plan_run(resolved)
    except PlanError as error:
        raise fail(f"plan: {error}") from None


@run_options
def plan(arguments: RunArguments, as_json: bool = JSON) -> None:
    """Predict the run's memory per device and per phase (parameters, gradients, optimizer states,
    activations, rollout weights and KV cache, reference, critic, reward model), the peak and the phase
    that sets it, and the devices needed; reads only the models' config.json. The data files need not exist."""
    resolved = arguments.resolved(validate=False, demo_note="planning the built-in demo")
    result = make_plan(resolved)
    typer.echo(result.to_json() if as_json else result.render())
    if result.problems():
        raise typer.Exit(1)
