"""`autotune plan`: the search space predicted for a card you do not have (no GPU needed)."""

from __future__ import annotations

import contextlib

import click

from autotune.cli.app import cli, echo_json
from autotune.vocabulary.errors import AutotuneError
from autotune.flags.arguments import space_arguments
from autotune.flags.flag import options
from autotune.flags.table import PLAN


@cli.command()
@options(PLAN)
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
    from autotune.specs.cards import card_names, find_card
    from autotune.estimate.stack import Stack
    from autotune.render.live import trace_progress
    from autotune.planner import Target, plan_for
    from autotune.render.plan_table import render_plan
    from autotune.vocabulary.units import parse_budget, parse_duration, parse_margin

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
        from autotune.host.output import FileSnapshot, Output
        from autotune.render.plot import check_out_file

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
            from autotune.render.plot import save_plan_plot

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
