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


# -- probe -------------------------------------------------------------------------------------
def config_options(func):
    """The levers of one configuration, shared by `probe` and `estimate`."""
    options = [
        click.option("--model", required=True, help="Hub id, gpt2-family name, or a local directory with config.json."),
        click.option("--micro-batch", type=int, required=True, help="Sequences per forward/backward pass."),
        click.option("--block-size", type=int, required=True, help="Tokens per sequence."),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-steps per optimizer step."),
        click.option("--precision", default="fp32", show_default=True, help="fp32, fp16 (with a gradient scaler) or bf16 (mixed precision)."),
        click.option("--checkpointing/--no-checkpointing", default=False, show_default=True, help="Gradient (activation) checkpointing."),
        click.option("--attention", default="sdpa", show_default=True, help="Attention implementation: sdpa, eager, flash_attention_2, ..."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_config(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention):
    from autotune.config import ProbeConfig

    return ProbeConfig(model=model, micro_batch=micro_batch, block_size=block_size, grad_accum=grad_accum,
                       precision=precision.lower(), checkpointing=checkpointing, attention=attention.lower())


def probe_settings_options(func):
    """How probes run, shared by `probe` and `search`."""
    options = [
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
        click.option("--safety-margin", default="5%", show_default=True,
                     help="Room kept free under the budget: a percentage of it or a size (256MiB). "
                          "A config fits when peak reserved + CUDA context + margin <= budget."),
        click.option("--warmup-steps", type=int, default=2, show_default=True, help="Optimizer steps before timing (at least 2)."),
        click.option("--measure-steps", type=int, default=3, show_default=True, help="Timed optimizer steps."),
        click.option("--probe-timeout", default="10m", show_default=True, help="Kill a probe after this long (e.g. 90s, 10m)."),
        click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_settings(device, safety_margin, warmup_steps, measure_steps, probe_timeout, trust_remote_code):
    from autotune.probe import ProbeSettings
    from autotune.units import parse_duration, parse_margin

    return ProbeSettings(device=device, margin=parse_margin(safety_margin), warmup_steps=warmup_steps,
                         measure_steps=measure_steps, timeout=parse_duration(probe_timeout, flag="--probe-timeout"),
                         trust_remote_code=trust_remote_code)


@cli.command()
@config_options
@click.option("--gpu-budget", required=True, help="Memory to fit in: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.")
@probe_settings_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def probe(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, gpu_budget,
          device, safety_margin, warmup_steps, measure_steps, probe_timeout, trust_remote_code, as_json):
    """Run one short, real training probe; exit status 0 if it fits, 1 if not."""
    from autotune.probe import run_probe
    from autotune.report import format_probe_result
    from autotune.units import parse_size

    budget = parse_size(gpu_budget)
    config = make_config(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention)
    settings = make_settings(device, safety_margin, warmup_steps, measure_steps, probe_timeout, trust_remote_code)
    result = run_probe(config, budget, settings=settings)
    if as_json:
        echo_json({"config": config.to_dict(), "config_key": config.key(), **result.to_dict()})
    else:
        click.echo(format_probe_result(config, result))
    sys.exit(0 if result.fits else 1)


# -- results store: studies, leaderboard, db ---------------------------------------------------
# Read commands import autotune.store (SQLAlchemy) inside their bodies and never torch, so that
# `autotune leaderboard` answers in a fraction of a second.

def db_option(func):
    return click.option("--db", metavar="URL", default=None, help=DB_HELP)(func)


@cli.command()
@db_option
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="A table for people, or a JSON list.")
def studies(db, fmt):
    """List the studies in the results database, with probe counts and best throughput."""
    from autotune.report import render_studies
    from autotune.store import open_store

    with open_store(db) as store:
        rows = store.studies()
    click.echo(render_studies(rows, fmt))


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show only the N fastest configurations.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True,
              help="A table for people, a JSON list, or CSV with a header row.")
@db_option
def leaderboard(study, top, fmt, db):
    """Rank a study's configurations that fit, fastest first."""
    from autotune.report import render_leaderboard
    from autotune.store import open_store

    with open_store(db) as store:
        rows = store.leaderboard(study, top=top)
    click.echo(render_leaderboard(rows, fmt))


@cli.group("db")
def db_group():
    """Manage the results database."""


@db_group.command("upgrade")
@db_option
def db_upgrade(db):
    """Upgrade the results database's schema to this version of autotune."""
    from autotune.store import upgrade_database

    report = upgrade_database(db)
    if report.changed:
        click.echo(f"{report.url}: upgraded from {report.before or 'empty'} to {report.after}")
    else:
        click.echo(f"{report.url}: already at {report.after}")
