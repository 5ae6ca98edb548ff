"""``rlplat serve``: the Tinker-compatible service, until interrupted."""

from __future__ import annotations

import os
import signal
import threading
from typing import List, Optional

import typer

from rlplat.cli.command_line import fail


def parse_overrides(overrides: List[str]) -> tuple[dict, dict]:
    """``engine.KEY=VALUE`` and ``rollout.KEY=VALUE`` (values read as YAML) into the two build configs."""
    import yaml

    nodes: dict[str, dict] = {"engine": {}, "rollout": {}}
    for item in overrides:
        key, sep, value = item.partition("=")
        node, dot, name = key.partition(".")
        if not sep or not dot or node not in nodes or not name:
            raise fail(f"rlplat serve: override {item!r} is not engine.KEY=VALUE or rollout.KEY=VALUE")
        nodes[node][name] = yaml.safe_load(value)
    return nodes["engine"], nodes["rollout"]


def serve(
    model: str = typer.Option(..., "--model", help="A local Hugging Face model folder: the base every client trains."),
    overrides: Optional[List[str]] = typer.Argument(None, help="engine.KEY=VALUE or rollout.KEY=VALUE: the engine's and rollout's build configs."),
    engine: str = typer.Option("fsdp2", "--engine", help="The training engine (it must split its step and hand out its trainable state)."),
    rollout: str = typer.Option("hf", "--rollout", help="The rollout that samples."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; another than loopback needs an API key."),
    port: int = typer.Option(8000, "--port", help="Port to bind (0: a free one)."),
    api_key: Optional[List[str]] = typer.Option(None, "--api-key", help="An accepted X-API-Key (tml-...); repeat for more. Also RLPLAT_SERVE_API_KEYS (comma separated)."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where save_state writes (default: a new temporary folder)."),
    name: Optional[str] = typer.Option(None, "--name", help="The base_model name clients use (default: the model folder's path)."),
    max_snapshots: int = typer.Option(8, "--max-snapshots", help="Sampler weights kept in memory (the newest)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the engine (the adapters' initialisation)."),
    processes: int = typer.Option(1, "--processes", help="Worker processes (above 1: on a local Ray cluster, the engine sharded over them)."),
) -> None:
    """Serve the Tinker API over rlplat's engines: point the tinker SDK at it with
    `tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")` (any tml- key on loopback)."""
    from rlplat_tinker.serve import start

    keys = list(api_key or []) + [key for key in os.environ.get("RLPLAT_SERVE_API_KEYS", "").split(",") if key]
    engine_config, rollout_config = parse_overrides(list(overrides or []))
    try:
        running = start(model, engine=engine, rollout=rollout, host=host, port=port, keys=keys, state_dir=state_dir,
                        base_model=name, engine_config=engine_config, rollout_config=rollout_config,
                        max_snapshots=max_snapshots, seed=seed, processes=processes)
    except (FileNotFoundError, ValueError) as error:
        raise fail(str(error)) from None
    typer.echo(f"rlplat serve: {running.base_url} (base_model {running.service.base_model!r}; states in {running.state_dir}); "
               "Ctrl-C stops", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
