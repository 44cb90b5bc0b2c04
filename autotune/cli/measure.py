"""`autotune probe` (one real training probe) and `autotune estimate` (its memory, predicted)."""

from __future__ import annotations

import sys

import click

from autotune import defaults
from autotune.cli.app import STACK_HELP, cli, echo_json
from autotune.cli.options import (
    DURATION,
    check_cpu_ranks,
    config_options,
    evaluation_asked,
    make_config,
    make_settings,
    probe_settings_options,
)
from autotune.errors import BadInput
from autotune.recipes import peft_text  # (torch-free: the --peft flags as a config stores them)
from autotune.status import ProbeStatus


@cli.command()
@config_options
@click.option("--gpu-budget", required=True, help="Memory to fit in: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.")
@probe_settings_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def probe(
    model,
    micro_batch,
    block_size,
    grad_accum,
    precision,
    checkpointing,
    attention,
    optimizer,
    weights,
    compile_,
    allocator,
    liger,
    trainer,
    gpus,
    strategy,
    nodes,
    task,
    target_length,
    num_labels,
    peft,
    lora_rank,
    lora_alpha,
    lora_dropout,
    lora_targets,
    eval_batch,
    eval_logits,
    eval_accumulation_steps,
    generate,
    generation_max_length,
    num_beams,
    gpu_budget,
    device,
    safety_margin,
    warmup_steps,
    measure_steps,
    measure_seconds,
    probe_timeout,
    trust_remote_code,
    max_compile_seconds,
    rendezvous,
    as_json,
):
    """Run one short, real training probe; exit status 0 if it fits, 1 if not."""
    from autotune.probe import run_probe
    from autotune.report import format_probe_result
    from autotune.units import parse_budget

    budget = parse_budget(gpu_budget)
    config = make_config(
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
        optimizer,
        weights,
        peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets),
        compile_,
        allocator,
        liger,
        evaluation_asked(eval_batch, eval_logits, eval_accumulation_steps, generate, generation_max_length, num_beams),
        gpus,
        strategy,
        nodes,
        budget_bytes=budget,
        trainer=trainer,
    )
    settings = make_settings(
        device,
        safety_margin,
        warmup_steps,
        measure_steps,
        measure_seconds,
        probe_timeout,
        trust_remote_code,
        max_compile_seconds,
        rendezvous,
    )
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
    if as_json:
        echo_json({"config": config.to_dict(), "config_key": config.key(), "task": config.task, **result.to_dict()})
    else:
        click.echo(format_probe_result(config, result))
    sys.exit(0 if result.fits else 1)


@cli.command()
@config_options
@click.option(
    "--gpu-budget",
    default=None,
    help="Also say whether it fits in this much memory: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.",
)
@click.option(
    "--safety-margin",
    default=defaults.SAFETY_MARGIN_TEXT,
    show_default=True,
    help="Room kept free under the budget: a percentage of it or a size (256MiB).",
)
@click.option(
    "--device-type",
    default="cuda",
    show_default=True,
    help="cuda: predict a GPU run; cpu: predict what a CPU probe accounts.",
)
@click.option(
    "--timeout",
    "timeout_text",
    type=DURATION,
    default=f"{defaults.ESTIMATE_TIMEOUT_SECONDS:.0f}s",
    show_default=True,
    help="Give up tracing after this long.",
)
@click.option("--no-cache", is_flag=True, help="Trace again even if this estimate is cached.")
@click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run.")
@click.option(
    "--stack", "stack_text", default=None, callback=lambda ctx, param, text: _stack_text(text), help=STACK_HELP
)
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as one JSON object.")
def estimate(
    model,
    micro_batch,
    block_size,
    grad_accum,
    precision,
    checkpointing,
    attention,
    optimizer,
    weights,
    compile_,
    allocator,
    liger,
    trainer,
    gpus,
    strategy,
    nodes,
    task,
    target_length,
    num_labels,
    peft,
    lora_rank,
    lora_alpha,
    lora_dropout,
    lora_targets,
    eval_batch,
    eval_logits,
    eval_accumulation_steps,
    generate,
    generation_max_length,
    num_beams,
    gpu_budget,
    safety_margin,
    device_type,
    timeout_text,
    no_cache,
    trust_remote_code,
    stack_text,
    as_json,
):
    """Predict a configuration's training memory without a GPU; with --gpu-budget, exit 1 if it will not fit."""
    from autotune.budget import Budget
    from autotune.estimate import estimate_memory
    from autotune.live import trace_progress
    from autotune.estimate.stack import Stack
    from autotune.estimate_report import render_estimate
    from autotune.units import parse_budget, parse_duration, parse_margin

    budget = Budget.of(parse_budget(gpu_budget), parse_margin(safety_margin)) if gpu_budget is not None else None
    stack = Stack.parse(stack_text)
    timeout = parse_duration(timeout_text, flag="--timeout")
    config = make_config(
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
        optimizer,
        weights,
        peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets),
        compile_,
        allocator,
        liger,
        evaluation_asked(eval_batch, eval_logits, eval_accumulation_steps, generate, generation_max_length, num_beams),
        gpus,
        strategy,
        nodes,
        budget_bytes=budget.total_bytes if budget is not None else None,
        trainer=trainer,
    )
    # One trace: a line every 30 s in a pipe (a 7B model traces in about 15), so that a mistake the
    # trace finds (LoRA targets that match nothing) is still the one line a script reads.
    with trace_progress(quiet=as_json, what=f"tracing {config.label()}", every=30.0):
        result = estimate_memory(
            config,
            device_type=device_type.lower(),
            timeout=timeout,
            use_cache=not no_cache,
            trust_remote_code=trust_remote_code,
            stack=stack,
        )
    if as_json:
        echo_json(result.to_dict(budget))
    else:
        click.echo(render_estimate(result, budget))
    sys.exit(0 if budget is None or budget.fits(result.required_bytes) else 1)


def _stack_text(text: str | None) -> str | None:
    """--stack as given, each library named once (Stack.parse reads the versions): a second
    `torch=` would silently replace the first, and an empty value would mean the installed ones."""
    if text is None:
        return None
    names = [part.partition("=")[0].strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise click.UsageError("--stack is empty; give library=version pairs such as torch=1.13, or leave it out")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise click.UsageError(
            f"--stack names {', '.join(twice)} more than once ({text.strip()[:80]}); give each library one version"
        )
    return text
