"""`autotune train`: the fine-tune, with a study's winner (searching first if need be)."""

from __future__ import annotations

import sys

import click

from autotune.cli.app import cli, echo_json
from autotune.flags.arguments import recipe_arguments
from autotune.flags.flag import options
from autotune.flags.table import DB, TASK, data_flags
from autotune.flags.values import COUNT, DEVICE, PASSES, RATE, STEPS


@cli.command()
@click.option(
    "--study", default=None, help="A finished study whose winner to train with [default with --model: MODEL-BUDGET]."
)
@click.option(
    "--model",
    default=None,
    help="Model to train; with --gpu-budget and no finished study for them, a search runs first.",
)
@click.option(
    "--gpu-budget",
    default=None,
    help="Memory to fit in (8GiB, 7.5GiB, 8192MiB, 8GB or bytes); with --study alone it overrides the study's budget.",
)
@options(data_flags(required=True))
@click.option(
    "--eval-split", default=None, help="Evaluation data: a split name, a file, or a share of the blocks held out (5%)."
)
@click.option(
    "--output-dir", default=None, help="Checkpoints, the model and autotune-run.json [default: ./autotune-runs/STUDY]."
)
@click.option(
    "--max-steps", type=STEPS, default=None, help="Optimizer steps in all (a resumed run counts the earlier ones)."
)
@click.option("--epochs", type=PASSES, default=None, help="Passes over the data instead of --max-steps [default: 1].")
@click.option(
    "--device",
    type=DEVICE,
    default=None,
    help="auto, cpu, cuda or cuda:N [default: the device type the study measured on].",
)
@click.option("--resume", is_flag=True, help="Go on from the latest checkpoint in --output-dir.")
@click.option("--learning-rate", type=RATE, default=5e-5, show_default=True, help="Peak learning rate (linear decay).")
@click.option(
    "--save-steps", type=STEPS, default=500, show_default=True, help="Save a checkpoint every N optimizer steps."
)
@click.option("--random-init", is_flag=True, help="Start from random weights even where the model has trained ones.")
@click.option(
    "--merge",
    is_flag=True,
    help="LoRA: after training, also save the base with the adapters merged in, a whole model, in OUTPUT_DIR/merged.",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run.")
@click.option(
    "--gpus",
    type=COUNT,
    default=None,
    help="Ranks (one GPU each) to train on, started by torchrun: a study's winner trains on the ranks it was "
    "probed on (this must repeat them); with --model and --gpu-budget the search runs on as many "
    "[default: the winner's].",
)
@options((DB,))
@click.option(
    "--json", "as_json", is_flag=True, help="Print the run's summary as one JSON object (progress goes to stderr)."
)
@options(TASK)
def train(
    study,
    model,
    gpu_budget,
    dataset,
    text_column,
    target_column,
    label_column,
    eval_split,
    output_dir,
    max_steps,
    epochs,
    device,
    resume,
    tokenizer,
    learning_rate,
    save_steps,
    random_init,
    merge,
    trust_remote_code,
    gpus,
    db,
    as_json,
    task,
    target_length,
    num_labels,
    **recipe_flags,
):
    """Train with a study's winning configuration under its budget; exit status 1 if it runs out of memory."""
    from autotune.render import tables
    from autotune.train import TrainOptions
    from autotune.train import train as run
    from autotune.vocabulary.units import parse_budget

    budget = parse_budget(gpu_budget) if gpu_budget is not None else None
    options = TrainOptions(
        dataset=dataset,
        output_dir=output_dir,
        max_steps=max_steps,
        epochs=epochs,
        device=device,
        text_column=text_column,
        target_column=target_column,
        label_column=label_column,
        eval_split=eval_split,
        resume=resume,
        tokenizer=tokenizer,
        learning_rate=learning_rate,
        save_steps=save_steps,
        random_init=random_init,
        merge=merge,
        trust_remote_code=trust_remote_code,
    )
    out = sys.stderr if as_json else sys.stdout
    outcome = run(
        options,
        study=study,
        model=model,
        gpu_budget=budget,
        task=task,
        target_length=target_length,
        num_labels=num_labels,
        **recipe_arguments(**recipe_flags),  # (the --peft and evaluation flags)
        gpus=gpus,
        db=db,
        echo=lambda line: click.echo(line, file=out),
        on_search_start=lambda *a: click.echo(tables.format_search_header(*a), file=out),
        on_search_event=lambda e: click.echo(tables.format_event(e), file=out),
    )
    if as_json:
        echo_json(outcome.summary.to_dict())
    else:
        click.echo("")
        click.echo(tables.render_run_summary(outcome.summary))
    if not outcome.finished:
        click.echo(f"autotune: {outcome.message}", err=True)
        sys.exit(1)
