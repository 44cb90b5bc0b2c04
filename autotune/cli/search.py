"""`autotune search` (a study, on this machine's workers) and `autotune worker` (joining one)."""

from __future__ import annotations

import contextlib
import sys

import click

from autotune.cli.app import cli, echo_json
from autotune.flags.flag import options
from autotune.flags.table import DB, DEVICE_HELP, SEARCH
from autotune.flags.values import COUNT, DEVICE, DURATION


@cli.command()
@options(SEARCH)
def search(
    db,
    as_json,
    workers,
    oversubscribe,
    launcher,
    ray_address,
    slurm_partition,
    slurm_time,
    slurm_parallel,
    slurm_option,
    dry_run,
    from_file,
    **flags,
):
    """Find the fastest configuration that fits the budget, by probing."""
    from autotune.cli.from_file import apply_recipe_file

    if from_file is not None:  # (before the imports below: a file refused costs no torch import)
        apply_recipe_file(from_file, flags)
    from autotune.render import tables
    from autotune.launchers.choose import make_launcher
    from autotune.search.launch import dry_run_script
    from autotune.render.live import LiveLine
    from autotune.search import search as run
    from autotune.search.request_flags import read_search_flags

    read = read_search_flags(flags, workers=workers, oversubscribe=oversubscribe)
    model, budget, space_args, settings, options = read.model, read.budget, read.space_args, read.settings, read.options
    chosen = make_launcher(
        launcher,
        workers=workers,
        ray_address=ray_address,
        slurm_partition=slurm_partition,
        slurm_time=slurm_time,
        slurm_parallel=slurm_parallel,
        slurm_options=slurm_option,
        dry_run=dry_run,
    )
    if chosen is not None:
        workers = workers or 1
    if dry_run:
        script = dry_run_script(chosen, model, budget, settings, options, workers, space_args, db)
        if script is None:
            click.echo(
                "autotune: the study is finished over this space: `autotune search` answers from the database "
                "and submits no job (--fresh searches it again).",
                err=True,
            )
            return
        click.echo(script)
        return
    out = sys.stderr if as_json else sys.stdout
    # On a terminal, the probe in flight is shown live (replaced by its result line); not in a log.
    live = LiveLine(out) if out.isatty() and workers is None else None
    say = live.print if live is not None else (lambda line: click.echo(line, file=out))
    with live or contextlib.nullcontext():
        outcome = run(
            model,
            budget,
            settings=settings,
            options=options,
            db=db,
            workers=workers,
            oversubscribe=oversubscribe,
            launcher=chosen,
            on_start=lambda *a: say(tables.format_search_header(*a)),
            on_event=lambda e: say(tables.format_event(e, show_worker=workers is not None)),
            on_progress=live.progress if live is not None else None,
            **space_args,
        )
    for failure in outcome.failures:
        click.echo(f"autotune: warning: {failure}", err=True)
    if as_json:
        echo_json(tables.search_summary(outcome))
    else:
        if outcome.leaderboard:
            click.echo("")
            click.echo(tables.render_leaderboard(outcome.leaderboard[:10], "table"))
        click.echo("")
        click.echo(tables.explain_winner(outcome))
        click.echo(tables.format_search_footer(outcome))
    sys.exit(outcome.exit_status)


@cli.command()
@click.option("--study", default=None, help="The study to join, as `autotune search --study` named it.")
@click.option(
    "--queue",
    is_flag=True,
    help="Serve the service's queue instead: take the oldest search this device can serve (autotune serve), "
    "run it, take the next; join running ones when none waits.",
)
@click.option("--device", type=DEVICE, default="auto", show_default=True, help=DEVICE_HELP)
@click.option(
    "--allow-other-device",
    is_flag=True,
    help="Join even though this device (or its driver and library versions) differs from the study's.",
)
@click.option("--max-trials", type=COUNT, default=None, help="Stop this worker after this many probes.")
@click.option("--max-searches", type=COUNT, default=None, help="With --queue: stop after running this many searches.")
@click.option(
    "--timeout",
    type=DURATION,
    default=None,
    help="End this worker within this long (e.g. 30m): its probe in flight is stopped at the deadline.",
)
@click.option(
    "--patience",
    type=COUNT,
    default=None,
    help="Stop after this many probes without a better config [default: the study's].",
)
@click.option(
    "--probe-timeout", type=DURATION, default=None, help="Kill a probe after this long [default: the study's]."
)
@options((DB,))
@click.option(
    "--json", "as_json", is_flag=True, help="Print this worker's outcome as one JSON object (progress goes to stderr)."
)
def worker(
    study, queue, device, allow_other_device, max_trials, max_searches, timeout, patience, probe_timeout, db, as_json
):
    """Join a study from this machine and probe its configurations until it is done or stopped."""
    from autotune.render import tables
    from autotune.vocabulary.errors import BadInput
    from autotune.vocabulary.units import parse_duration
    from autotune.search import join_study

    if queue == (study is not None):
        raise BadInput("give --study NAME (join that study) or --queue (serve the service's queue), one of them.")
    if max_searches is not None and not queue:
        raise BadInput("--max-searches counts a queue worker's searches; give it with --queue (or use --max-trials).")
    if queue:
        from autotune.search.queue_worker import serve_queue

        study_only = [
            flag
            for flag, value in (
                ("--allow-other-device", allow_other_device),
                ("--max-trials", max_trials),
                ("--patience", patience),
                ("--probe-timeout", probe_timeout),
            )
            if value
        ]
        if study_only:
            raise BadInput(
                f"{', '.join(study_only)} apply to joining one study; a queue worker runs each search with "
                f"its own settings (leave them out with --queue)."
            )
        outcome = serve_queue(
            db,
            device,
            say=lambda line: click.echo(line, err=as_json),
            max_searches=max_searches,
            timeout=parse_duration(timeout) if timeout else None,
        )
        if as_json:
            echo_json({"searches": outcome.searches, "joined": outcome.joined, "interrupted": outcome.interrupted})
        sys.exit(outcome.exit_status)

    out = sys.stderr if as_json else sys.stdout
    outcome = join_study(
        study,
        db=db,
        device=device,
        allow_other_device=allow_other_device,
        max_trials=max_trials,
        timeout=parse_duration(timeout) if timeout else None,
        patience=patience,
        probe_timeout=parse_duration(probe_timeout, flag="--probe-timeout") if probe_timeout else None,
        on_start=lambda *a: click.echo(tables.format_search_header(*a), file=out),
        on_event=lambda e: click.echo(tables.format_event(e, show_worker=True), file=out),
    )
    if as_json:
        echo_json(tables.search_summary(outcome))
    else:
        click.echo(tables.format_search_footer(outcome))
    sys.exit(outcome.exit_status)
