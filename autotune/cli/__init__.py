"""The command line: `cli` (the click group) and `main` (the entry point). Importing the
command modules registers their commands on the group."""

from autotune.cli.app import cli, main
from autotune.cli import measure, node, plan, results, search, serve, share, train  # noqa: F401  (registers the commands)

__all__ = ["cli", "main"]
