"""Commands that turn a stored study into something to share: `autotune plot` (a figure) and
`autotune report` (Markdown for an issue or a pull request). They read the results database only
and never import torch; matplotlib is imported where the figure is drawn."""

from __future__ import annotations

import click

from autotune.cli.app import cli
from autotune.flags.flag import options
from autotune.flags.table import DB


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="The file to write: .png, .svg or .pdf (matplotlib), or .html (plotly) [default: <study>.png here].",
)
@options((DB,))
def plot(study, out, db):
    """Plot a study's tokens/s against memory needed, with the budget, frontier, OOMs and pick."""
    from autotune.render.plot import plot_study

    click.echo(f"wrote {plot_study(study, db, out)}")


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option(
    "--out", type=click.Path(dir_okay=False), default=None, help="Write the Markdown here [default: print it]."
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw the plot here and link it [default: beside --out, as .png; none when printing].",
)
@options((DB,))
def report(study, out, plot_file, db):
    """Summarise a study in Markdown: setup, leaderboard, the pick and why, probe counts, plot."""
    from autotune.render.report import study_report

    text = study_report(study, db, out, plot_file)
    if out is None:
        click.echo(text)
    else:
        click.echo(f"wrote {out}")
