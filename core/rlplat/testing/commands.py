"""Conformance suite for CLI commands (kind ``command``)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner


class CommandConformance:
    """Fixtures to provide: ``command`` (what the factory returns: a ``typer.Typer`` or a function) and
    ``command_name``."""

    @pytest.fixture
    def mounted_app(self, command, command_name) -> typer.Typer:
        app = typer.Typer()

        @app.callback()
        def root() -> None:
            """A root so that the command is mounted as a sub-command, as rlplat does."""

        if isinstance(command, typer.Typer):
            app.add_typer(command, name=command_name)
        else:
            app.command(name=command_name)(command)
        return app

    def test_is_a_typer_app_or_a_function(self, command):
        assert isinstance(command, typer.Typer) or callable(command)

    def test_help_exits_cleanly(self, mounted_app, command_name):
        result = CliRunner().invoke(mounted_app, [command_name, "--help"])
        assert result.exit_code == 0, result.output
        assert command_name in result.output
