"""The command line. Each command parses its flags, calls one library function, prints.
No SQL, sessions, Optuna or torch here: those live in the modules the commands call."""

from __future__ import annotations

import json
import sys

import click

from autotune import __version__
from autotune.errors import AutotuneError

DEVICE_HELP = "auto (CUDA if present, else CPU), cpu, cuda or cuda:N."
DB_HELP = "SQLAlchemy URL of the results database [default: $AUTOTUNE_DB, else a SQLite file in the user data directory]."


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="autotune")
def cli() -> None:
    """Find the fastest training configuration that fits your GPU, by measuring it."""


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit status 2; bugs keep tracebacks."""
    try:
        cli.main(standalone_mode=False)
    except AutotuneError as exc:
        click.echo(f"autotune: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("autotune: interrupted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        hint = f" (see: autotune {exc.ctx.command_path.partition(' ')[2]} --help)".replace("  ", " ") if exc.ctx else ""
        click.echo(f"autotune: error: {exc.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"autotune: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


# Commands are defined below, one section per concept, each calling into its own module.
