"""``rlplat doctor``: versions, devices, plugins and known-bad combinations of this environment (or of a
version table given with ``--versions``); exits 1 when it finds a known-bad combination."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

SEVERITY_STYLES = {"error": "red", "warning": "yellow", "note": "dim"}


def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    versions: Optional[Path] = typer.Option(
        None, "--versions", help="Judge this JSON table of distribution -> version instead of what is installed "
        "(to vet an environment before building it); no devices or plugins are read then."),
) -> None:
    """Python, torch (CUDA, NCCL), transformers, Ray, vllm, sglang, megatron-core and peft versions; the
    devices; each plugin's status; and combinations the constraint files forbid (exit code 1)."""
    from rlplat.doctor import read_version_table, report

    if versions is not None:
        try:
            table = read_version_table(versions)
        except ValueError as error:
            typer.echo(f"rlplat doctor: --versions {error}", err=True)
            raise typer.Exit(2)
        result = report(table)
    else:
        result = report()
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_report(result)
    if not result["ok"]:
        raise typer.Exit(1)


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(soft_wrap=False)
    versions = Table(title=f"versions ({result['source']})", show_header=False)
    versions.add_column("name", no_wrap=True)
    versions.add_column("version")
    for name, version in result["versions"].items():
        absent = "none (a CPU build of torch)" if name in ("cuda", "nccl") else "not installed"
        versions.add_row(name, escape(version) if version else f"[dim]{absent}[/]")
    console.print(versions)
    if result["devices"]:
        devices = Table(title="devices")
        for column in ("device", "name", "memory (GiB)", "capability"):
            devices.add_column(column)
        for device in result["devices"]:
            devices.add_row(device["device"], escape(device["name"] or "-"), str(device.get("memory_gib") or "-"),
                            device.get("capability", "-"))
        console.print(devices)
    if result["plugins"]:
        plugins = Table(title="plugins")
        for column in ("plugin", "distribution", "version", "status"):
            plugins.add_column(column, overflow="fold")
        for plugin in result["plugins"]:
            status = plugin["status"] if plugin["status"] == "ok" else f"{plugin['status']}: {plugin['reason']}"
            style = "green" if plugin["status"] == "ok" else "red"
            if plugin["unusable"]:  # each one is a problem line below
                status += f"; unusable here: {', '.join(item['kind'] + ' ' + item['name'] for item in plugin['unusable'])}"
                style = "yellow" if style == "green" else style
            plugins.add_row(escape(plugin["plugin"]), escape(plugin["distribution"] or "-"), escape(plugin["version"] or "-"),
                            f"[{style}]{escape(status)}[/]")
        console.print(plugins)
    if not result["problems"]:
        console.print("[green]no problems found[/]")
    for problem in result["problems"]:
        style = SEVERITY_STYLES[problem["severity"]]
        remedy = f" [dim]({escape(problem['remedy'])})[/]" if problem["remedy"] else ""
        console.print(f"[{style}]{problem['severity']}[/]: {escape(problem['message'])}{remedy}")
    errors = sum(problem["severity"] == "error" for problem in result["problems"])
    console.print(f"[red]{errors} known-bad combination(s) or broken plugin(s)[/]" if errors else "[green]doctor: ok[/]")
