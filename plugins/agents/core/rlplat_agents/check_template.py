"""``rlplat check-template MODEL_OR_TOKENIZER_DIR``: does the tokenizer's chat template only append?

Multi-turn rollouts append the model's sampled tokens verbatim and the tokens the template adds for
tool results and feedback; that equals the template's rendering of the conversation only when
rendering more messages never changes earlier ones. The command renders synthetic conversations turn
by turn and in one pass (:func:`rlplat_agents.chat.check_append_only`), prints one row per
conversation and where the first one diverges, and exits 0 when the template is append-only, 1 when it
is not, 2 on bad input (no such directory, no tokenizer, no chat template, bad ``--template-kwargs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"rlplat check-template: {message}", err=True)
    return typer.Exit(code)


def parse_template_kwargs(text: Optional[str]) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise fail(f"--template-kwargs is not valid JSON ({error}): pass an object, "
                   f"e.g. '{{\"enable_thinking\": false}}'")
    if not isinstance(value, dict):
        raise fail(f"--template-kwargs must be a JSON object of template variables, got {text!r}")
    return value


def load_tokenizer(directory: Path) -> Any:
    if not directory.exists():
        raise fail(f"{directory} does not exist; pass a local model or tokenizer directory (Hugging Face layout)")
    if not directory.is_dir():
        raise fail(f"{directory} is not a directory; pass a local model or tokenizer directory (Hugging Face layout)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise fail(f"{directory} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); pass a model or tokenizer "
                   f"directory saved by save_pretrained")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as error:
        raise fail(f"cannot load a tokenizer from {directory}: {type(error).__name__}: {error}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise fail(
            f"the tokenizer in {directory} has no chat template (no chat_template in tokenizer_config.json, no "
            f"chat_template.jinja): there is nothing to check. Multi-turn rollouts render turns with a chat "
            f"template; use an instruct model's tokenizer, or add one (rlplat/testing/templates holds examples)"
        )
    return tokenizer


def print_report(report: Any, directory: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(soft_wrap=False)
    typer.echo(f"Chat template of {directory}: end of turn {report.end_of_turn!r}")
    table = Table()
    table.add_column("conversation", no_wrap=True)
    table.add_column("append-only", no_wrap=True)
    table.add_column("first diverging message", no_wrap=True)
    for check in report.conversations:
        if check.status == "append-only":
            table.add_row(escape(check.name), "[green]yes[/]", "")
        elif check.status == "diverges":
            where = check.divergence
            table.add_row(escape(check.name), "[red]no[/]",
                          escape(f"{where.message_index} ({where.role})"))
        else:
            table.add_row(escape(check.name), "[yellow]unsupported[/]", "not checked")
    console.print(table)
    for check in report.conversations:
        if check.status == "diverges":
            where = check.divergence
            typer.echo(f"{check.name}: message {where.message_index} ({where.role}) diverges "
                       f"({where.check}, {where.level}): {where.detail}")
            if where.expected or where.rendered:
                typer.echo(f"  expected: {where.expected!r}")
                typer.echo(f"  rendered: {where.rendered!r}")
        elif check.status == "unsupported":
            typer.echo(f"{check.name}: not checked, {check.error}")


def check_template(
    model: Path = typer.Argument(..., help="A local model or tokenizer directory (Hugging Face layout)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    template_kwargs: Optional[str] = typer.Option(
        None, "--template-kwargs",
        help="A JSON object of extra template variables (apply_chat_template keyword arguments, the run's "
             "data.apply_chat_template_kwargs), e.g. '{\"enable_thinking\": false}'.",
    ),
) -> None:
    """Check that a chat template only appends across turns: render synthetic conversations (tool calls,
    parallel calls, follow-ups, system messages) turn by turn and in one pass. Exit 0 when append-only,
    1 when not (the first diverging message of each conversation is printed), 2 on bad input."""
    from rlplat_agents.chat import check_append_only

    kwargs = parse_template_kwargs(template_kwargs)
    tokenizer = load_tokenizer(model)
    try:
        report = check_append_only(tokenizer, template_kwargs=kwargs)
    except ValueError as error:
        raise fail(str(error))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    elif report.problem is None:
        print_report(report, model)
    if report.problem is not None:
        typer.echo(f"rlplat check-template: {report.problem}", err=True)
        raise typer.Exit(1)
    if report.append_only:
        if not as_json:
            typer.echo(f"append-only: yes ({len(report.conversations)} conversations)")
        return
    diverging = report.diverging
    if not as_json:
        if diverging:
            typer.echo(f"append-only: NO ({len(diverging)} of {len(report.conversations)} conversations diverge): "
                       f"a multi-turn rollout's tokens would differ from the template's rendering of its conversation")
        else:
            typer.echo("append-only: unknown (the template raised on every conversation)")
    raise typer.Exit(1)
