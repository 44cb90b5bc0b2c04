"""`autotune probe` (one real training probe) and `autotune estimate` (its memory, predicted)."""

from __future__ import annotations

import sys

import click

from autotune.vocabulary import defaults
from autotune.cli.app import cli, echo_json
from autotune.flags.arguments import check_cpu_ranks, make_settings, recipe_arguments
from autotune.flags.flag import Part, by_part, options
from autotune.flags.table import ESTIMATE, PROBE
from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.status import ProbeStatus


@cli.command()
@options(PROBE)
def probe(**values):
    """Run one short, real training probe; exit status 0 if it fits, 1 if not."""
    from autotune.probe import run_probe
    from autotune.render.tables import format_probe_result
    from autotune.vocabulary.units import parse_budget

    parts = by_part(PROBE, values)
    what = parts[Part.WHAT]
    budget = parse_budget(what.pop("gpu_budget"))
    config = make_config(**what, **parts[Part.SPACE], budget_bytes=budget)
    settings = make_settings(**parts[Part.PROBE])
    check_cpu_ranks(config.gpus, settings.device)
    result = run_probe(config, budget, settings=settings)
    if result.status == ProbeStatus.SKIPPED:
        # A search skips what this device cannot run and goes on; here it is the one config asked
        # for (a precision, kernel, optimizer or speed lever this machine lacks, a compile over
        # --max-compile-seconds): a mistake of the command, whatever the reason.
        raise BadInput(
            f"the config asked for ({config.label()}) cannot be probed here: "
            f"{(result.error or '').rstrip('.')}; change or leave out the flag that asks for it, or probe "
            f"on a device that runs it."
        )
    if parts[Part.OUTPUT]["as_json"]:
        echo_json({"config": config.to_dict(), "config_key": config.key(), "task": config.task, **result.to_dict()})
    else:
        click.echo(format_probe_result(config, result))
    sys.exit(0 if result.fits else 1)


@cli.command()
@options(ESTIMATE)
def estimate(**values):
    """Predict a configuration's training memory without a GPU; with --gpu-budget, exit 1 if it will not fit."""
    from autotune.results.budget import Budget
    from autotune.estimate import estimate_memory
    from autotune.render.live import trace_progress
    from autotune.estimate.stack import Stack
    from autotune.render.estimate_table import render_estimate
    from autotune.vocabulary.units import parse_budget, parse_duration, parse_margin

    parts = by_part(ESTIMATE, values)
    what, own = parts[Part.WHAT], parts[Part.COMMAND]
    gpu_budget = what.pop("gpu_budget")
    budget = Budget.of(parse_budget(gpu_budget), parse_margin(own["safety_margin"])) if gpu_budget is not None else None
    stack = Stack.parse(own["stack_text"])
    timeout = parse_duration(own["timeout_text"], flag="--timeout")
    config = make_config(**what, **parts[Part.SPACE], budget_bytes=budget.total_bytes if budget is not None else None)
    as_json = parts[Part.OUTPUT]["as_json"]
    # One trace: a line every 30 s in a pipe (a 7B model traces in about 15), so that a mistake the
    # trace finds (LoRA targets that match nothing) is still the one line a script reads.
    with trace_progress(quiet=as_json, what=f"tracing {config.label()}", every=30.0):
        result = estimate_memory(
            config,
            device_type=own["device_type"].lower(),
            timeout=timeout,
            use_cache=not own["no_cache"],
            trust_remote_code=own["trust_remote_code"],
            stack=stack,
        )
    if as_json:
        echo_json(result.to_dict(budget))
    else:
        click.echo(render_estimate(result, budget))
    sys.exit(0 if budget is None or budget.fits(result.required_bytes) else 1)


def make_config(
    *,
    model,
    micro_batch,
    block_size,
    grad_accum,
    precision,
    checkpointing,
    attention,
    task,
    target_length,
    num_labels,
    optimizer=defaults.OPTIMIZER,
    weights="fp32",
    compile_=False,
    allocator="default",
    liger=False,
    gpus=1,
    strategy=None,
    nodes=1,
    trainer=None,
    budget_bytes=None,
    **recipe_flags,
):
    """The one config `probe` and `estimate` are about (their CONFIG flags, flags/table.py; the
    --peft and evaluation ones in `recipe_flags`), checked before any process starts; with
    `budget_bytes`, its tables too (the embedding, a learned position table, a classification head
    of --num-labels: ModelSpec.check_shapes)."""
    from autotune.levers.config import ProbeConfig
    from autotune.specs.models import resolve_model
    from autotune.levers.recipes import DEFAULT_TRAINER
    from autotune.search.space import single_config

    recipe = recipe_arguments(**recipe_flags)
    # The levers are checked before the model is looked for (a typo answers without a hub lookup).
    levers = dict(
        micro_batch=micro_batch,
        block_size=block_size,
        grad_accum=grad_accum,
        precision=precision.lower(),
        checkpointing=checkpointing,
        attention=attention.lower(),
        optimizer=optimizer.strip().lower(),
        weights=weights.strip().lower(),
        peft=recipe["peft"],
        compile=compile_,
        allocator=allocator.strip().lower(),
        liger=liger,
        gpus=gpus,
        strategy=strategy.strip().lower() if strategy else None,
        nodes=nodes,
        trainer=trainer.strip().lower() if trainer else DEFAULT_TRAINER,
    )
    ProbeConfig(model=model, **levers)
    spec = resolve_model(model)
    config = single_config(
        spec,
        task=task,
        target_length=target_length,
        num_labels=num_labels,
        evaluation=recipe["evaluation"],
        **levers,
    )
    spec.check_shapes(budget_bytes, num_labels=config.num_labels)
    say_task_assumed(spec.config, task)
    return config


def say_task_assumed(model_config: dict, task: str | None) -> None:
    """A note on stderr when the task was assumed from the model type (no --task, no head named in
    its config.json): stdout stays the command's answer."""
    from autotune.levers.tasks import task_note

    if (note := task_note(model_config, task)) is not None:
        click.echo(f"autotune: note: {note}", err=True)
