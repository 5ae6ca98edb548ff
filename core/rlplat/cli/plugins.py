"""``rlplat plugins list|info``: what is installed, what it registers, and whether it works."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlplat.api_version import PLUGIN_API_VERSION, UNDECLARED
from rlplat.plugins import KINDS

app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)


def status_style(status: str) -> str:
    if status == "ok":
        return "green"
    if status.startswith("disabled"):
        return "dim"
    return "red" if status.startswith(("failed", "conflict")) else "yellow"


def registrations_of(name: str) -> list[tuple[str, str, str]]:
    """``(kind, entry name, status)`` for every entry of plugin ``name``."""
    from rlplat import registry

    conflicted = registry.conflicts()
    rows = []
    for entry in registry.entries_of_plugin(name):
        if (entry.kind, entry.name) in conflicted:
            others = [e.origin for e in conflicted[(entry.kind, entry.name)] if e.plugin != name]
            status = f"conflict: also registered by {', '.join(others) or 'the same plugin'}"
        else:
            status = entry.status
        rows.append((entry.kind, entry.name, status))
    return rows


def plugin_status(record) -> str:
    return record.status if record.status == "ok" else f"{record.status}: {record.reason}"


@app.command("list")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of a table."),
) -> None:
    """List every plugin: distribution, version, what it registers (kind: name) and its status (a plugin
    whose declared plugin API range does not admit this rlplat's is failed, with both versions)."""
    from rlplat import registry

    records = registry.plugins()
    if as_json:
        payload = [
            {
                "plugin": r.name,
                "distribution": r.distribution,
                "version": r.version,
                "status": r.status,
                "reason": r.reason,
                "plugin_api": r.api,
                "entries": [{"kind": k, "name": n, "status": s} for k, n, s in registrations_of(r.name)],
            }
            for r in records
        ]
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console(soft_wrap=False)
    if not records:
        console.print("No rlplat plugins are installed (entry-point group 'rlplat').")
        return
    table = Table(title=f"rlplat plugins (plugin API {PLUGIN_API_VERSION})", show_lines=True)
    table.add_column("plugin", no_wrap=True)
    table.add_column("distribution", no_wrap=True)
    table.add_column("version", no_wrap=True)
    table.add_column("registers", overflow="fold", ratio=3)
    table.add_column("status", overflow="fold", ratio=1)
    for record in records:
        by_kind: dict[str, list[str]] = {}
        for kind, name, status in registrations_of(record.name):
            label = escape(name) if status == "ok" else f"{escape(name)} [{status_style(status)}]({escape(status)})[/]"
            by_kind.setdefault(kind, []).append(label)
        lines = [f"{kind}: {', '.join(names)}" for kind, names in by_kind.items()]
        status = plugin_status(record)
        table.add_row(
            escape(record.name),
            escape(record.distribution or "-"),
            escape(record.version or "-"),
            "\n".join(lines) or "-",
            f"[{status_style(status)}]{escape(status)}[/]",
        )
    console.print(table)


@app.command("info")
def info(name: str = typer.Argument(..., help="A plugin name, a distribution, or a registered entry name.")) -> None:
    """Show one plugin (or the entries of that name): module, version, each entry and its status."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    try:
        record = registry.plugin(name)
    except RegistryError as plugin_error:
        matches = [e for e in registry.entries() if e.name == name]
        matches += [e for (kind, n), claims in registry.conflicts().items() if n == name for e in claims]
        if not matches:
            typer.echo(f"rlplat: {plugin_error}", err=True)
            raise typer.Exit(2)
        for entry in matches:
            typer.echo(f"{entry.kind} {entry.name!r} is registered by plugin {entry.plugin!r}")
        record = registry.plugin(matches[0].plugin)
    typer.echo(f"plugin:       {record.name}")
    typer.echo(f"distribution: {record.distribution or '-'} {record.version or ''}".rstrip())
    typer.echo(f"module:       {record.module or '-'}")
    typer.echo(f"status:       {plugin_status(record)}")
    declared = f"declares {record.api}" if record.api else f"declares none (taken as {UNDECLARED})"
    typer.echo(f"plugin API:   {declared}; rlplat provides {PLUGIN_API_VERSION}")
    if record.traceback:
        typer.echo("traceback:\n" + record.traceback.rstrip())
    for entry in sorted(registry.entries_of_plugin(record.name), key=lambda e: (KINDS.index(e.kind), e.name)):
        typer.echo(f"\n  {entry.kind}: {entry.name}")
        if entry.description:
            typer.echo(f"    {entry.description}")
        factory = entry.factory if isinstance(entry.factory, str) else getattr(entry.factory, "__qualname__", repr(entry.factory))
        typer.echo(f"    factory:  {factory}")
        if entry.requires:
            typer.echo(f"    requires: {', '.join(entry.requires)}")
        status = dict(((k, n), s) for k, n, s in registrations_of(record.name))[(entry.kind, entry.name)]
        typer.echo(f"    status:   {status}")
