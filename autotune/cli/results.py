"""Commands that read the results database: studies, leaderboard, best, db upgrade.
They import autotune.store (SQLAlchemy) inside their bodies and never torch, so that
`autotune leaderboard` answers in a fraction of a second."""

from __future__ import annotations

import click

from autotune.cli.app import cli
from autotune.flags.flag import options
from autotune.flags.table import BEST_FORMATS, DB


@cli.command()
@options((DB,))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="A table for people, or a JSON list.",
)
def studies(db, fmt):
    """List the studies in the results database, with probe counts and best throughput."""
    from autotune.render.tables import render_studies
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.studies()
    click.echo(render_studies(rows, fmt))


@cli.command()
@click.option("--study", default=None, help="Only the runs of this study.")
@options((DB,))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="A table for people, or a JSON list.",
)
def runs(study, db, fmt):
    """List the full fine-tunes (`autotune train`) and how each ended."""
    from autotune.render.tables import render_runs
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.runs.all(study)
    click.echo(render_runs(rows, fmt))


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show only the N fastest configurations.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "csv"]),
    default="table",
    show_default=True,
    help="A table for people, a JSON list, or CSV with a header row.",
)
@options((DB,))
def leaderboard(study, top, fmt, db):
    """Rank a study's configurations that fit, fastest first."""
    from autotune.render.tables import render_leaderboard
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.leaderboard(study, top=top)
        confirmation = store.study(rows[0].study).confirmation if rows else None
    click.echo(render_leaderboard(rows, fmt, confirmation))


@cli.group("db")
def db_group():
    """Manage the results database."""


@db_group.command("upgrade")
@options((DB,))
def db_upgrade(db):
    """Upgrade the results database's schema to this version of autotune."""
    from autotune.store import upgrade_database

    report = upgrade_database(db)
    if report.changed:
        click.echo(f"{report.url}: upgraded from {report.before or 'empty'} to {report.after}")
    else:
        click.echo(f"{report.url}: already at {report.after}")


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(BEST_FORMATS),
    default="json",
    show_default=True,
    help="json/yaml: the config and its measurements; trainer-args: TrainingArguments and model kwargs; "
    "cli: flags for the Hugging Face example scripts; accelerate: the config file for "
    "`accelerate launch --config_file` (processes, FSDP or DDP, mixed precision); trl: SFTConfig "
    "and SFTTrainer's arguments (JSON); axolotl, llamafactory: their training YAML; lightning: "
    "a LightningCLI YAML (docs/tools.md).",
)
@click.option(
    "--update",
    "update_path",
    default=None,
    metavar="FILE",
    help="Write the winner into your own TRL, axolotl, LLaMA-Factory or TrainingArguments file (the one "
    "`search --from` read): only the keys the search decided change, the rest and its comments stay; "
    "prints the diff.",
)
@click.option("--out", "out_path", default=None, metavar="FILE", help="With --update: write there, not over FILE.")
@options((DB,))
def best(study, fmt, update_path, out_path, db):
    """Print a study's winning configuration for the fine-tune."""
    from autotune.handoff import best as find_best
    from autotune.specs.models import shown_reference

    if out_path is not None and update_path is None:
        raise click.UsageError("--out goes with --update FILE (the other formats print to stdout).")
    if update_path is not None and click.get_current_context().get_parameter_source("fmt").name == "COMMANDLINE":
        raise click.UsageError("--update writes your file in its own tool's format: leave out --format.")
    chosen = find_best(study, db)
    # On stderr, so that `$(autotune best --format cli)` takes the flags alone.
    if study is None:
        click.echo(
            f"autotune: the most recent study, {chosen.row.study!r} (--model {shown_reference(chosen.config.model)})",
            err=True,
        )
    if update_path is not None:
        return _update(chosen, update_path, out_path)
    for note in chosen.notes(fmt):
        click.echo(f"autotune: {note}", err=True)
    click.echo(chosen.render(fmt))


def _update(chosen, update_path: str, out_path: str | None) -> None:
    """`best --update FILE [--out OUT]`: the file with the winner's levers, written, and the diff printed."""
    from pathlib import Path

    from autotune.handoff import tools
    from autotune.host.output import check_destination, through_link
    from autotune.recipe_files import TOOLS
    from autotune.recipe_files.write_back import update_file, write

    flag = "--out" if out_path is not None else "--update"
    update = update_file(chosen, update_path)
    # Refused before anything is said or written: a FIFO, a device, a read-only file, a missing folder.
    out = check_destination(Path(out_path).expanduser() if out_path is not None else update.source.path, flag)
    tool = update.source.tool
    notes = chosen.notes("trainer-args" if tool == "trainer" else tool)
    if tool in tools.TOOL_FORMATS:
        notes += [f"note: {line}" for line in tools.notes(chosen, tool)]
    for note in notes:
        click.echo(f"autotune: {note}", err=True)
    if not update.changed and out == update.source.path:
        click.echo(f"{out}: the file already has the winner's levers; nothing written")
        return
    shown = through_link(out)
    write(update, out, flag)
    if diff := update.diff(out):
        click.echo(diff, nl=False)
    click.echo(
        f"autotune: wrote {shown} ({TOOLS[tool]}; {len(update.changed)} keys decided by study {chosen.row.study!r})",
        err=True,
    )
