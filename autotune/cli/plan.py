"""`autotune plan`: the search space predicted for a card you do not have (no GPU needed)."""

from __future__ import annotations

import contextlib

import click

from autotune.cli.app import cli, echo_json
from autotune.vocabulary.errors import AutotuneError
from autotune.flags.arguments import space_arguments
from autotune.flags.flag import options
from autotune.flags.table import PLAN
from autotune.vocabulary.units import parse_duration, parse_int_list


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
    gpu_counts,
    tokens,
    epochs,
    prices,
    sort,
    fmt,
    **space_flags,
):
    """Predict every candidate's memory and speed on a card, without one: what fits, ranked (predicted).
    With several cards or GPU counts and the run's --tokens: which to rent, how many, how long, how much."""
    from autotune.specs.cards import card_names, find_card
    from autotune.estimate.stack import Stack
    from autotune.render.live import trace_progress
    from autotune.planner import Target, plan_for
    from autotune.render.plan_table import render_plan
    from autotune.vocabulary.units import parse_budget, parse_margin

    if gpu_name is not None and gpu_name.strip().lower() == "list":
        click.echo("\n".join(card_names()))
        return
    if gpu_name is None and gpu_budget is None:
        raise click.UsageError("give --gpu NAME (a card to plan for) or --gpu-budget SIZE (a CUDA card of that size)")
    counts = parse_int_list(gpu_counts, flag="--gpus")
    names = [name.strip() for name in (gpu_name or "").split(",") if name.strip()]
    several = len(names) > 1 or len(counts) > 1 or (gpu_name or "").strip().lower() == "all"
    if tokens is not None or epochs is not None or several:
        return _rentals(
            model,
            names,
            counts,
            gpu_budget=gpu_budget,
            safety_margin=safety_margin,
            tokens=tokens,
            epochs=epochs,
            prices=prices,
            sort=sort,
            fmt=fmt,
            exact=exact,
            timeout_text=timeout_text,
            no_cache=no_cache,
            trust_remote_code=trust_remote_code,
            stack_text=stack_text,
            as_json=as_json,
            plot_file=plot_file,
            ignored={"--study": study, "--top": top},
            space_flags=space_flags,
        )
    for flag, value in (("--prices", prices), ("--format", fmt if fmt != "table" else None)):
        if value is not None:
            raise click.UsageError(f"{flag} goes with --tokens N (the run's size, to time and price it).")
    cpu = gpu_name is not None and gpu_name.strip().lower() == "cpu"
    card = find_card(gpu_name) if gpu_name is not None and not cpu else None
    target = Target.of(
        card, parse_budget(gpu_budget) if gpu_budget is not None else None, parse_margin(safety_margin), cpu=cpu
    )
    space_args = space_arguments(**space_flags, gpus=counts[0])
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


def _rentals(
    model,
    names,
    counts,
    *,
    gpu_budget,
    safety_margin,
    tokens,
    epochs,
    prices,
    sort,
    fmt,
    exact,
    timeout_text,
    no_cache,
    trust_remote_code,
    stack_text,
    as_json,
    plot_file,
    ignored,
    space_flags,
):
    """`plan --gpu A,B,... --gpus 1,2,... --tokens N`: each card and count's fastest fitting config,
    the run's time and cost (planner/rental_plan.py), as a table, CSV or JSON."""
    from autotune.estimate.stack import Stack
    from autotune.planner.prices import read_prices
    from autotune.planner.rental_plan import plan_rentals
    from autotune.render.live import trace_progress
    from autotune.render.rental_table import render_rentals, rentals_csv
    from autotune.specs.cards import CARDS, find_cards
    from autotune.vocabulary.units import parse_margin, parse_tokens

    if tokens is None and epochs is None:
        raise click.UsageError(
            "several cards or GPU counts are weighed for a run: give its size with --tokens N (e.g. 100M), "
            "or --dataset D --epochs E."
        )
    if tokens is not None and epochs is not None:
        raise click.UsageError("give the run's size once: --tokens N, or --dataset D --epochs E.")
    if epochs is not None and not space_flags.get("dataset"):
        raise click.UsageError("--epochs counts passes over --dataset D: give the data (or --tokens N instead).")
    if gpu_budget is not None:
        raise click.UsageError("--gpu-budget goes with one card; with several, each card's own memory is its budget.")
    for flag, value in ignored.items():
        if value:
            raise click.UsageError(f"{flag} goes with one card and one count (leave it out with several).")
    cards = list(CARDS) if [n.lower() for n in names] == ["all"] else find_cards(names)
    run_tokens = parse_tokens(tokens) if tokens is not None else None
    book = read_prices(prices)  # (before any trace: a price file of another shape is a mistake said now)
    space_args = space_arguments(**space_flags, gpus=max(counts))  # (each count's space: plan_rentals)
    plot_out = None
    if plot_file:
        from autotune.host.output import Output
        from autotune.render.rental_plot import check_rental_plot

        check_rental_plot(plot_file)  # (refused before the traces, and opened now: see plan's own --plot)
        plot_out = Output(plot_file, "--plot")
    with plot_out or contextlib.nullcontext(), trace_progress(quiet=as_json or fmt == "csv") as progress:
        result = plan_rentals(
            model,
            cards,
            counts,
            space_args,
            tokens=run_tokens,
            epochs=epochs,
            prices=book,
            margin=parse_margin(safety_margin),
            sort=sort,
            exact=exact,
            timeout=parse_duration(timeout_text, flag="--timeout"),
            use_cache=not no_cache,
            trust_remote_code=trust_remote_code,
            on_progress=progress,
            stack=Stack.parse(stack_text),
        )
        if plot_out is not None:
            from autotune.render.rental_plot import save_rental_plot

            click.echo(f"wrote {save_rental_plot(result, plot_out)}", err=True)
    if as_json:
        echo_json(result.to_dict())
    elif fmt == "csv":
        click.echo(rentals_csv(result), nl=False)
    else:
        click.echo(render_rentals(result))
