"""This plugin's tests run the ``rlplat`` command in their own ``tmp_path``: rlplat.testing's ``cli_run``,
put back over the repository root conftest's, which runs it in the repository's root. ``cli_in_process``
is rlplat.testing's too (:mod:`rlplat.testing.cli`)."""

from rlplat.testing.pytest_plugin import cli_run  # noqa: F401  (a fixture)
