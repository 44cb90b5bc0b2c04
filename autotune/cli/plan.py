"""`autotune plan`: the search space predicted for a card you do not have (no GPU needed)."""

from __future__ import annotations

import contextlib

import click

from autotune import defaults
from autotune.cli.app import STACK_HELP, cli, echo_json
from autotune.cli.options import db_option, space_arguments, space_options
from autotune.errors import AutotuneError


@cli.command()
@click.option("--model", required=True, help="Hub id, gpt2-family name, or a local directory with config.json.")
@click.option(
    "--gpu",
    "gpu_name",
    default=None,
    help="The card to plan for, by name (h100, a100-40gb, rtx4090, l4, ...: see `autotune plan --gpu list`), "
    "or cpu (what CPU probes account).",
)
@click.option(
    "--gpu-budget",
    default=None,
    help="Memory to fit in (8GiB, ...) [default: the card's memory]; with --gpu cpu, required.",
)
@space_options
@click.option(
    "--safety-margin",
    default=defaults.SAFETY_MARGIN_TEXT,
    show_default=True,
    help="Room kept free under the budget: a percentage of it or a size (256MiB).",
)
@click.option(
    "--exact",
    is_flag=True,
    help="Trace every candidate instead of each group's smallest and largest micro-batch (interpolating between).",
)
@click.option(
    "--study",
    default=None,
    help="A study whose measurements to show beside the predictions [default: the latest of this model and "
    "space on such a card, if any].",
)
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show only the first N rows of the table.")
@click.option(
    "--plot", "plot_file", default=None, help="Also draw the predicted points, as `autotune plot` draws a study's."
)
@click.option(
    "--timeout",
    "timeout_text",
    default=f"{defaults.ESTIMATE_TIMEOUT_SECONDS:.0f}s",
    show_default=True,
    help="Give up tracing one configuration after this long.",
)
@click.option("--no-cache", is_flag=True, help="Trace again even where an estimate is cached.")
@click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run.")
@click.option("--stack", "stack_text", default=None, help=STACK_HELP)
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(
    model,
    gpu_name,
    gpu_budget,
    safety_margin,
    exact,
    study,
    top,
    plot_file,
    timeout_text,
    no_cache,
    trust_remote_code,
    stack_text,
    db,
    as_json,
    **space_flags,
):
    """Predict every candidate's memory and speed on a card, without one: what fits, ranked (predicted)."""
    from autotune.cards import card_names, find_card
    from autotune.estimate.stack import Stack
    from autotune.live import trace_progress
    from autotune.planner import Target, plan_for
    from autotune.planner.render import render_plan
    from autotune.units import parse_budget, parse_duration, parse_margin

    if gpu_name is not None and gpu_name.strip().lower() == "list":
        click.echo("\n".join(card_names()))
        return
    if gpu_name is None and gpu_budget is None:
        raise click.UsageError("give --gpu NAME (a card to plan for) or --gpu-budget SIZE (a CUDA card of that size)")
    cpu = gpu_name is not None and gpu_name.strip().lower() == "cpu"
    card = find_card(gpu_name) if gpu_name is not None and not cpu else None
    target = Target.of(
        card, parse_budget(gpu_budget) if gpu_budget is not None else None, parse_margin(safety_margin), cpu=cpu
    )
    space_args = space_arguments(**space_flags)
    stack = Stack.parse(stack_text)
    plot_out = cached = None
    if plot_file:
        from autotune.estimate.cache import EstimateCache
        from autotune.output import FileSnapshot, Output
        from autotune.plot import check_out_file

        # Before the traces (seconds to minutes), not after: the plot's file is opened now (hidden,
        # empty), so a place that takes no file is refused before any work; and should drawing it
        # still fail (a disk that fills meanwhile), the estimates the traces cached are put back.
        check_out_file(plot_file, "--plot")
        plot_out = Output(plot_file, "--plot")
        cached = FileSnapshot(EstimateCache().path) if not no_cache else None
    with plot_out or contextlib.nullcontext():
        # A line on stderr as the traces land: redrawn on a terminal, every few seconds in a pipe.
        with trace_progress(quiet=as_json) as progress:
            result = plan_for(
                model,
                target,
                space_args,
                exact=exact,
                timeout=parse_duration(timeout_text, flag="--timeout"),
                use_cache=not no_cache,
                trust_remote_code=trust_remote_code,
                db=db,
                study=study,
                on_progress=progress,
                stack=stack,
            )
        if plot_out is not None:
            from autotune.plot import save_plan_plot

            try:
                wrote = save_plan_plot(result, plot_out)
            except AutotuneError:
                if cached is not None:
                    cached.restore()
                raise
            click.echo(f"wrote {wrote}", err=True)
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(render_plan(result, top))
