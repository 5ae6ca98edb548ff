"""The ``rlplat`` command line: one module per command, assembled in :mod:`rlplat.cli.main`."""
