"""`autotune search` (a study, on this machine's workers) and `autotune worker` (joining one)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from autotune import defaults
from autotune.cli.app import DEVICE_HELP, cli, echo_json
from autotune.cli.options import (
    COUNT,
    DEVICE,
    DURATION,
    REAL,
    SECONDS,
    check_cpu_ranks,
    db_option,
    make_settings,
    probe_settings_options,
    space_arguments,
    space_options,
)
from autotune.errors import EXIT_INTERRUPTED, EXIT_NOTHING_FITS, EXIT_TERMINATED, EXIT_UNMEASURED
from autotune.launchers import LAUNCHERS
from autotune.status import StopReason

if TYPE_CHECKING:
    from autotune.probe.settings import ProbeSettings
    from autotune.search import SearchOptions


@cli.command()
@click.option(
    "--model",
    default=None,
    help="Hub id, gpt2-family name, or a local directory with config.json [required unless --from names it].",
)
@click.option("--gpu-budget", required=True, help="Memory to fit in: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.")
@click.option(
    "--from",
    "from_file",
    default=None,
    metavar="FILE",
    help="Keep the recipe of your own TRL, axolotl or LLaMA-Factory config (or a TrainingArguments JSON): "
    "its model, sequence length, effective batch, LoRA, optimizer and evaluation; the free levers are "
    "searched, and `autotune best --update FILE` writes the winner back into it (docs/tools.md).",
)
@space_options
@click.option(
    "--strategy",
    default=defaults.STRATEGY,
    show_default=True,
    help="predictive (a speed model refitted after each probe), frontier, tpe, grid (OOM-pruned) or grid-full.",
)
@click.option(
    "--max-trials", type=COUNT, default=None, help="Stop after this many probes (reused and skipped ones are free)."
)
@click.option(
    "--timeout",
    type=DURATION,
    default=None,
    help="End the whole command within this long (e.g. 30m), confirmation included: the probe in flight is "
    "stopped at the deadline, none starts that could not end before it; the same command goes on.",
)
@click.option("--patience", type=COUNT, default=None, help="Stop after this many probes without a better config.")
@click.option("--study", default=None, help="Study name; the same name resumes [default: MODEL-BUDGET].")
@click.option("--fresh", is_flag=True, help="Probe again even where a stored result could be reused.")
@click.option(
    "--predict/--no-predict",
    default=True,
    show_default=True,
    help="Estimate every candidate's memory first (no GPU needed): skip hopeless ones, order the rest.",
)
@click.option(
    "--confirm/--no-confirm",
    default=True,
    show_default=True,
    help="Before saying the pick, measure the configs within noise of the best again until it is told "
    "apart or declared a tie.",
)
@click.option(
    "--predict-margin",
    type=REAL,
    default=None,
    help="Skip a config only if predicted over the budget by more than this share of it; within it, a "
    "probe decides [default: 0.1 on CUDA; 0 on CPU, where the estimate equals the probe to the byte].",
)
@probe_settings_options
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Search in N worker processes on this machine: one per GPU (each gets one CUDA_VISIBLE_DEVICES entry), "
    "or N CPU workers with --device cpu (at most one per core). Other machines join with `autotune worker`.",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default="local",
    show_default=True,
    help="Where the --workers start: local (this machine), ray (Ray tasks on a cluster: --ray-address) or "
    "slurm (a Slurm job array: --slurm-*); every worker pulls probes from the database (--db).",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="HOST:PORT",
    help="The Ray cluster's head [default: $RAY_ADDRESS, else the cluster `ray start` runs here].",
)
@click.option("--slurm-partition", default=None, help="The partition the workers' job array runs in.")
@click.option("--slurm-time", default=None, help="The job's time limit, as sbatch takes it (e.g. 2:00:00).")
@click.option("--slurm-parallel", type=COUNT, default=None, help="Array tasks running at once (sbatch --array ...%K).")
@click.option(
    "--slurm-option", multiple=True, help="One more sbatch option for the job script (repeatable), e.g. --account=ml."
)
@click.option(
    "--dry-run", is_flag=True, help="With --launcher slurm: print the workers' job script and submit nothing."
)
@click.option(
    "--oversubscribe",
    is_flag=True,
    help="Allow more CPU workers than cores (up to 4 per core): their timings then share the cores.",
)
@click.option(
    "--heartbeat",
    type=SECONDS,
    default=defaults.HEARTBEAT_SECONDS,
    show_default=True,
    help=f"Seconds between a worker's heartbeats; a worker silent for {defaults.STALE_BEATS} of them is presumed "
    f"dead and its probe retried.",
)
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object (progress goes to stderr).")
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
    from autotune import report
    from autotune.launchers.choose import make_launcher
    from autotune.search.launch import dry_run_script
    from autotune.live import LiveLine
    from autotune.search import search as run

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
        click.echo(dry_run_script(chosen, model, budget, settings, options, workers, space_args))
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
            on_start=lambda *a: say(report.format_search_header(*a)),
            on_event=lambda e: say(report.format_event(e, show_worker=workers is not None)),
            on_progress=live.progress if live is not None else None,
            **space_args,
        )
    for failure in outcome.failures:
        click.echo(f"autotune: warning: {failure}", err=True)
    if as_json:
        echo_json(report.search_summary(outcome))
    else:
        if outcome.leaderboard:
            click.echo("")
            click.echo(report.render_leaderboard(outcome.leaderboard[:10], "table"))
        click.echo("")
        click.echo(report.explain_winner(outcome))
        click.echo(report.format_search_footer(outcome))
    sys.exit(search_exit_status(outcome))


@dataclass(frozen=True, slots=True)
class SearchFlags:
    """`autotune search`'s flags, read: what the library's search takes. One reading for the command
    line and the service (autotune/service/submissions.py), so a request either would refuse is
    refused by both with the same line."""

    model: str
    budget: int
    space_args: dict
    settings: ProbeSettings
    options: SearchOptions


def read_search_flags(flags: dict, *, workers: int | None = None, oversubscribe: bool = False) -> SearchFlags:
    """click's values of search's flags (less --db, --json, --workers, --oversubscribe) as the
    library's arguments, checked as far as the flags alone allow (AutotuneError otherwise)."""
    from autotune.search import SearchOptions
    from autotune.units import parse_budget, parse_duration

    from autotune.errors import BadInput

    flags = dict(flags)
    if flags.get("model") is None:
        raise BadInput(
            "--model: give the model to search (a hub id, a gpt2-family name or a directory), or --from a "
            "config file that names it."
        )
    model, budget = flags.pop("model"), parse_budget(flags.pop("gpu_budget"))
    probe = {name: flags.pop(name) for name in PROBE_SETTING_FLAGS}
    option_flags = {
        name: flags.pop(name)
        for name in (
            "study",
            "strategy",
            "max_trials",
            "patience",
            "fresh",
            "predict",
            "predict_margin",
            "heartbeat",
            "confirm",
            "timeout",
        )
    }
    space_args = space_arguments(**flags)
    settings = make_settings(**probe)
    check_search_ranks(model, budget, space_args, settings.device, workers, oversubscribe)
    timeout = option_flags.pop("timeout")
    options = SearchOptions(
        **{("heartbeat_seconds" if k == "heartbeat" else k): v for k, v in option_flags.items()},
        timeout=parse_duration(timeout) if timeout else None,
    )
    return SearchFlags(model, budget, space_args, settings, options)


# The probe settings' flags, in make_settings' order.
PROBE_SETTING_FLAGS = (
    "device",
    "safety_margin",
    "warmup_steps",
    "measure_steps",
    "measure_seconds",
    "probe_timeout",
    "trust_remote_code",
    "max_compile_seconds",
    "rendezvous",
)


def check_search_ranks(
    model: str, budget: int, space_args: dict, device: str, workers: int | None, oversubscribe: bool
) -> None:
    """What search's ranks, workers and labels ask of this machine and the model, refused before
    anything starts: a search on several nodes probes from this node, one probe at a time (no
    --workers); each CPU probe's ranks compute on this machine's cores (the --workers rule: with
    --workers, the fleet checks workers x ranks); a classification head of --num-labels fits the
    budget (ModelSpec.check_shapes, as for the embedding table)."""
    from autotune.errors import BadInput

    if workers is not None and space_args["nodes"] > 1:
        raise BadInput(
            f"--workers {workers} with --nodes {space_args['nodes']}: a search on several nodes runs each "
            f"probe on all of them from this node, one probe at a time; leave out --workers, or --nodes."
        )
    if workers is None:
        check_cpu_ranks(space_args["gpus"], device, oversubscribe=oversubscribe)
    if space_args.get("num_labels") is not None:
        from autotune.models import resolve_model

        resolve_model(model).check_shapes(budget, num_labels=space_args["num_labels"])


def search_exit_status(outcome) -> int:
    """0: a configuration fits and every candidate is settled (or a limit stopped the search as
    asked); 1: nothing fits; 3: some candidates could not be measured; 130: interrupted."""
    if outcome.stop_reason == StopReason.INTERRUPTED:
        return EXIT_INTERRUPTED
    if outcome.unmeasured:
        return EXIT_UNMEASURED
    if outcome.finished and outcome.best is None:
        return EXIT_NOTHING_FITS
    return 0


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
@db_option
@click.option(
    "--json", "as_json", is_flag=True, help="Print this worker's outcome as one JSON object (progress goes to stderr)."
)
def worker(
    study, queue, device, allow_other_device, max_trials, max_searches, timeout, patience, probe_timeout, db, as_json
):
    """Join a study from this machine and probe its configurations until it is done or stopped."""
    from autotune import report
    from autotune.errors import BadInput
    from autotune.units import parse_duration
    from autotune.search import join_study

    if queue == (study is not None):
        raise BadInput("give --study NAME (join that study) or --queue (serve the service's queue), one of them.")
    if max_searches is not None and not queue:
        raise BadInput("--max-searches counts a queue worker's searches; give it with --queue (or use --max-trials).")
    if queue:
        from autotune.service.queue_worker import serve_queue

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
        sys.exit(EXIT_TERMINATED if outcome.interrupted else 0)

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
        on_start=lambda *a: click.echo(report.format_search_header(*a), file=out),
        on_event=lambda e: click.echo(report.format_event(e, show_worker=True), file=out),
    )
    if as_json:
        echo_json(report.search_summary(outcome))
    else:
        click.echo(report.format_search_footer(outcome))
    sys.exit(search_exit_status(outcome))
