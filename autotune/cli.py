"""The command line. Each command parses its flags, calls one library function, prints.
No SQL, sessions, Optuna or torch here: those live in the modules the commands call."""

from __future__ import annotations

import contextlib
import json
import sys

import click

from autotune import defaults
from autotune.errors import AutotuneError
from autotune.processes import Terminated
from autotune.recipes import peft_text  # (torch-free: the --peft flags as a config stores them)
from autotune.status import StopReason
from autotune.version import __version__

# Exit statuses of `search` and `worker` (README, "Exit statuses"); 2 is a user's mistake throughout.
EXIT_NOTHING_FITS = 1        # every candidate measured or ruled out, and none fits the budget
EXIT_UNMEASURED = 3          # some candidates could not be measured (crashed, timed out, failed)
EXIT_INTERRUPTED = 130       # Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143        # SIGTERM (128 + SIGTERM)

DEVICE_HELP = "auto (CUDA if present, else CPU), cpu, cuda or cuda:N."
OPTIMIZER_HELP = ("adamw (fused AdamW), adafactor, sgd (momentum 0.9), adamw_8bit or paged_adamw_8bit (bitsandbytes): "
                  "TrainingArguments' optim names.")
WEIGHTS_HELP = "fp32 (master weights; mixed precision autocasts) or bf16 (pure bf16: weights, gradients, optimizer state)."
DB_HELP = "SQLAlchemy URL of the results database [default: $AUTOTUNE_DB, else a SQLite file in the user data directory]."


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="autotune")
def cli() -> None:
    """Find the fastest training configuration that fits your GPU, by measuring it."""


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit status 2; bugs keep tracebacks."""
    try:
        cli.main(standalone_mode=False)
    except AutotuneError as exc:
        click.echo(f"autotune: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, Terminated):
            click.echo("autotune: terminated (SIGTERM); run the same command to resume", err=True)
            sys.exit(EXIT_TERMINATED)
        click.echo("autotune: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.UsageError as exc:
        hint = f" (see: autotune {exc.ctx.command_path.partition(' ')[2]} --help)".replace("  ", " ") if exc.ctx else ""
        click.echo(f"autotune: error: {exc.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"autotune: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


# Commands are defined below, one section per concept, each calling into its own module.


# -- probe -------------------------------------------------------------------------------------
def config_options(func):
    """The levers of one configuration, shared by `probe` and `estimate`."""
    options = [
        click.option("--model", required=True, help="Hub id, gpt2-family name, or a local directory with config.json."),
        click.option("--micro-batch", type=int, required=True, help="Sequences per forward/backward pass."),
        click.option("--block-size", type=int, required=True, help="Tokens per sequence."),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-steps per optimizer step."),
        click.option("--precision", default=defaults.PRECISION, show_default=True, help="fp32, fp16 (with a gradient scaler) or bf16 (mixed precision)."),
        click.option("--checkpointing/--no-checkpointing", default=False, show_default=True, help="Gradient (activation) checkpointing."),
        click.option("--attention", default=defaults.ATTENTION, show_default=True, help="Attention implementation: sdpa, eager, flash_attention_2, ..."),
        click.option("--optimizer", default=defaults.OPTIMIZER, show_default=True, help=OPTIMIZER_HELP),
        click.option("--weights", default="fp32", show_default=True, help=WEIGHTS_HELP),
    ]
    for option in reversed(options):
        func = option(func)
    return task_options(func)


def task_options(func):
    """What is trained (recipe levers, never searched), shared by probe, estimate, search and train."""
    from autotune.tasks import TASK_HELP

    options = [
        click.option("--task", default=None, help=f"What is trained: {TASK_HELP}."),
        click.option("--target-length", type=int, default=None,
                     help="seq2seq: target tokens per example, from your data [default: 128, as run_summarization.py]."),
        click.option("--num-labels", type=int, default=None,
                     help="classification: labels of the head [default: the config's id2label, or 2]."),
        click.option("--peft", default=None, help="lora: LoRA adapters on a frozen base (needs peft); qlora: a 4-bit base "
                                                  "too (CUDA and bitsandbytes) [default: full fine-tuning]."),
        click.option("--lora-rank", type=int, default=None, help="LoRA rank r [default: 8]."),
        click.option("--lora-alpha", type=int, default=None, help="LoRA alpha [default: 16]."),
        click.option("--lora-dropout", type=float, default=None, help="LoRA dropout [default: 0.05]."),
        click.option("--lora-targets", default=None,
                     help="Modules that get adapters: all-linear, or names such as q_proj,v_proj [default: all-linear]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_config(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, task, target_length,
                num_labels, optimizer=defaults.OPTIMIZER, weights="fp32", peft=None):
    from autotune.config import ProbeConfig
    from autotune.models import resolve_model
    from autotune.space import single_config

    # The levers are checked before the model is looked for (a typo answers without a hub lookup).
    levers = dict(micro_batch=micro_batch, block_size=block_size, grad_accum=grad_accum, precision=precision.lower(),
                  checkpointing=checkpointing, attention=attention.lower(), optimizer=optimizer.strip().lower(),
                  weights=weights.strip().lower(), peft=peft)
    ProbeConfig(model=model, **levers)
    return single_config(resolve_model(model), task=task, target_length=target_length, num_labels=num_labels, **levers)



def probe_settings_options(func):
    """How probes run, shared by `probe` and `search`."""
    options = [
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
        click.option("--safety-margin", default=defaults.SAFETY_MARGIN_TEXT, show_default=True,
                     help="Room kept free under the budget: a percentage of it or a size (256MiB). "
                          "A config fits when peak reserved + CUDA context + margin <= budget."),
        click.option("--warmup-steps", type=int, default=defaults.WARMUP_STEPS, show_default=True, help="Optimizer steps before timing (at least 2)."),
        click.option("--measure-steps", type=int, default=defaults.MEASURE_STEPS, show_default=True, help="Timed optimizer steps, at least."),
        click.option("--measure-seconds", type=float, default=defaults.MEASURE_SECONDS, show_default=True,
                     help=f"Time steps until the window is at least this long (up to {defaults.MAX_MEASURE_STEPS} steps), "
                          f"so that fast configs are timed as steadily as slow ones."),
        click.option("--probe-timeout", default=f"{defaults.PROBE_TIMEOUT_SECONDS:.0f}s", show_default=True, help="Kill a probe after this long (e.g. 90s, 10m)."),
        click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_settings(device, safety_margin, warmup_steps, measure_steps, measure_seconds, probe_timeout, trust_remote_code):
    from autotune.probe import ProbeSettings
    from autotune.units import parse_duration, parse_margin

    return ProbeSettings(device=device, margin=parse_margin(safety_margin), warmup_steps=warmup_steps,
                         measure_steps=measure_steps, measure_seconds=measure_seconds,
                         timeout=parse_duration(probe_timeout, flag="--probe-timeout"), trust_remote_code=trust_remote_code)


@cli.command()
@config_options
@click.option("--gpu-budget", required=True, help="Memory to fit in: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.")
@probe_settings_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def probe(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, optimizer, weights, task,
          target_length, num_labels, peft, lora_rank, lora_alpha, lora_dropout, lora_targets,
          gpu_budget, device, safety_margin, warmup_steps, measure_steps, measure_seconds, probe_timeout, trust_remote_code,
          as_json):
    """Run one short, real training probe; exit status 0 if it fits, 1 if not."""
    from autotune.probe import run_probe
    from autotune.report import format_probe_result
    from autotune.units import parse_size

    budget = parse_size(gpu_budget)
    config = make_config(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, task,
                         target_length, num_labels, optimizer, weights,
                         peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets))
    settings = make_settings(device, safety_margin, warmup_steps, measure_steps, measure_seconds, probe_timeout, trust_remote_code)
    result = run_probe(config, budget, settings=settings)
    if as_json:
        echo_json({"config": config.to_dict(), "config_key": config.key(), "task": config.task, **result.to_dict()})
    else:
        click.echo(format_probe_result(config, result))
    sys.exit(0 if result.fits else 1)


# -- results store: studies, leaderboard, db ---------------------------------------------------
# Read commands import autotune.store (SQLAlchemy) inside their bodies and never torch, so that
# `autotune leaderboard` answers in a fraction of a second.

def db_option(func):
    return click.option("--db", metavar="URL", default=None, help=DB_HELP)(func)


@cli.command()
@db_option
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="A table for people, or a JSON list.")
def studies(db, fmt):
    """List the studies in the results database, with probe counts and best throughput."""
    from autotune.report import render_studies
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.studies()
    click.echo(render_studies(rows, fmt))


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show only the N fastest configurations.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True,
              help="A table for people, a JSON list, or CSV with a header row.")
@db_option
def leaderboard(study, top, fmt, db):
    """Rank a study's configurations that fit, fastest first."""
    from autotune.report import render_leaderboard
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.leaderboard(study, top=top)
    click.echo(render_leaderboard(rows, fmt))


@cli.group("db")
def db_group():
    """Manage the results database."""


@db_group.command("upgrade")
@db_option
def db_upgrade(db):
    """Upgrade the results database's schema to this version of autotune."""
    from autotune.store import upgrade_database

    report = upgrade_database(db)
    if report.changed:
        click.echo(f"{report.url}: upgraded from {report.before or 'empty'} to {report.after}")
    else:
        click.echo(f"{report.url}: already at {report.after}")


# -- search and the hand-off -------------------------------------------------------------------
@cli.command()
@click.option("--model", required=True, help="Hub id, gpt2-family name, or a local directory with config.json.")
@click.option("--gpu-budget", required=True, help="Memory to fit in: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.")
@click.option("--effective-batch", type=int, default=None,
              help="Sequences per optimizer step, kept fixed; accumulation = effective batch / micro-batch "
                   f"[default: {defaults.EFFECTIVE_BATCH}].")
@click.option("--effective-tokens", type=int, default=None,
              help=f"Tokens per optimizer step, for several --block-sizes [default: {defaults.EFFECTIVE_BATCH} x the largest block].")
@click.option("--micro-batches", default=None,
              help=f"Micro-batches to try [default: {','.join(map(str, defaults.MICRO_BATCHES))} up to the effective batch].")
@click.option("--block-sizes", default=None,
              help=f"Block sizes to try [default: {defaults.BLOCK_SIZE}, or the model's maximum if smaller].")
@click.option("--precisions", default=",".join(defaults.PRECISIONS), show_default=True, help="Precisions to try.")
@click.option("--checkpointing", "checkpointing_", default=",".join("on" if c else "off" for c in defaults.CHECKPOINTING),
              show_default=True, help="Gradient checkpointing: on, off or both.")
@click.option("--attention", default=",".join(defaults.ATTENTIONS), show_default=True, help="Attention implementations to try.")
@click.option("--optimizers", default=defaults.OPTIMIZER, show_default=True,
              help="Optimizers the search may choose among (a recipe lever: list only those you accept): " + OPTIMIZER_HELP)
@click.option("--weights", "weights_", default="fp32", show_default=True,
              help="Weights dtypes the search may choose among (fp32, bf16: a recipe lever).")
@click.option("--strategy", default=defaults.STRATEGY, show_default=True, help="frontier, tpe, grid (OOM-pruned) or grid-full.")
@click.option("--max-trials", type=int, default=None, help="Stop after this many probes (reused and skipped ones are free).")
@click.option("--timeout", default=None, help="Start no new probe after this long (e.g. 30m).")
@click.option("--patience", type=int, default=None, help="Stop after this many probes without a better config.")
@click.option("--study", default=None, help="Study name; the same name resumes [default: MODEL-BUDGET].")
@click.option("--fresh", is_flag=True, help="Probe again even where a stored result could be reused.")
@click.option("--predict/--no-predict", default=True, show_default=True,
              help="Estimate every candidate's memory first (no GPU needed): skip hopeless ones, order the rest.")
@click.option("--confirm/--no-confirm", default=True, show_default=True,
              help="Before saying the pick, measure the configs within noise of the best again until it is told "
                   "apart or declared a tie.")
@click.option("--predict-margin", type=float, default=defaults.PREDICT_MARGIN, show_default=True,
              help="Skip a config only if predicted over the budget by more than this share of it.")
@probe_settings_options
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Search in N worker processes on this machine: one per GPU (each gets one CUDA_VISIBLE_DEVICES entry), "
                   "or N CPU workers with --device cpu. Other machines join with `autotune worker`.")
@click.option("--heartbeat", type=float, default=defaults.HEARTBEAT_SECONDS, show_default=True,
              help=f"Seconds between a worker's heartbeats; a worker silent for {defaults.STALE_BEATS} of them is presumed "
                   f"dead and its probe retried.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object (progress goes to stderr).")
@task_options
def search(model, gpu_budget, effective_batch, effective_tokens, micro_batches, block_sizes, precisions, checkpointing_,
           attention, optimizers, weights_, task, target_length, num_labels, peft, lora_rank, lora_alpha, lora_dropout,
           lora_targets, strategy, max_trials, timeout, patience, study, fresh, predict, confirm,
           predict_margin, device, safety_margin, warmup_steps,
           measure_steps, measure_seconds, probe_timeout, trust_remote_code, workers, heartbeat, db, as_json):
    """Find the fastest configuration that fits the budget, by probing."""
    from autotune import report
    from autotune.config import ATTENTIONS, OPTIMIZERS, PRECISIONS
    from autotune.live import LiveLine
    from autotune.recipes import WEIGHTS
    from autotune.search import SearchOptions
    from autotune.search import search as run
    from autotune.units import parse_choice_list, parse_duration, parse_int_list, parse_size

    budget = parse_size(gpu_budget)
    ckpt = parse_choice_list(checkpointing_, flag="--checkpointing", allowed=("off", "on", "false", "true"))
    space_args = dict(
        micro_batches=parse_int_list(micro_batches, flag="--micro-batches") if micro_batches is not None else None,
        block_sizes=parse_int_list(block_sizes, flag="--block-sizes") if block_sizes is not None else None,
        precisions=parse_choice_list(precisions, flag="--precisions", allowed=PRECISIONS),
        checkpointing=tuple(dict.fromkeys(v in ("on", "true") for v in ckpt)),
        attentions=parse_choice_list(attention, flag="--attention", allowed=ATTENTIONS),
        effective_batch=effective_batch, effective_tokens=effective_tokens,
        task=task, target_length=target_length, num_labels=num_labels,
        optimizers=parse_choice_list(optimizers, flag="--optimizers", allowed=OPTIMIZERS),
        weights=parse_choice_list(weights_, flag="--weights", allowed=WEIGHTS),
        peft=peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets),
    )
    for flag, value in (("--effective-batch", effective_batch), ("--effective-tokens", effective_tokens)):
        if value is not None and value < 1:
            raise click.BadParameter(f"must be at least 1 (got {value})", param_hint=flag)
    settings = make_settings(device, safety_margin, warmup_steps, measure_steps, measure_seconds, probe_timeout, trust_remote_code)
    options = SearchOptions(study=study, strategy=strategy, max_trials=max_trials, patience=patience, fresh=fresh,
                            predict=predict, predict_margin=predict_margin, heartbeat_seconds=heartbeat, confirm=confirm,
                            timeout=parse_duration(timeout) if timeout else None)
    out = sys.stderr if as_json else sys.stdout
    # On a terminal, the probe in flight is shown live (replaced by its result line); not in a log.
    live = LiveLine(out) if out.isatty() and workers is None else None
    say = live.print if live is not None else (lambda line: click.echo(line, file=out))
    with live or contextlib.nullcontext():
        outcome = run(model, budget, settings=settings, options=options, db=db, workers=workers,
                      on_start=lambda *a: say(report.format_search_header(*a)),
                      on_event=lambda e: say(report.format_event(e, show_worker=workers is not None)),
                      on_progress=live.progress if live is not None else None, **space_args)
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
@click.option("--study", required=True, help="The study to join, as `autotune search --study` named it.")
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--allow-other-device", is_flag=True,
              help="Join even though this device (or its driver and library versions) differs from the study's.")
@click.option("--max-trials", type=int, default=None, help="Stop this worker after this many probes.")
@click.option("--timeout", default=None, help="Start no new probe on this worker after this long (e.g. 30m).")
@click.option("--patience", type=int, default=None, help="Stop after this many probes without a better config [default: the study's].")
@click.option("--probe-timeout", default=None, help="Kill a probe after this long [default: the study's].")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print this worker's outcome as one JSON object (progress goes to stderr).")
def worker(study, device, allow_other_device, max_trials, timeout, patience, probe_timeout, db, as_json):
    """Join a study from this machine and probe its configurations until it is done or stopped."""
    from autotune import report
    from autotune.units import parse_duration
    from autotune.search import join_study

    out = sys.stderr if as_json else sys.stdout
    outcome = join_study(study, db=db, device=device, allow_other_device=allow_other_device, max_trials=max_trials,
                         timeout=parse_duration(timeout) if timeout else None, patience=patience,
                         probe_timeout=parse_duration(probe_timeout, flag="--probe-timeout") if probe_timeout else None,
                         on_start=lambda *a: click.echo(report.format_search_header(*a), file=out),
                         on_event=lambda e: click.echo(report.format_event(e, show_worker=True), file=out))
    if as_json:
        echo_json(report.search_summary(outcome))
    else:
        click.echo(report.format_search_footer(outcome))
    sys.exit(search_exit_status(outcome))


@cli.command()
@click.option("--study", default=None, help="Study name [default: the most recent one].")
@click.option("--format", "fmt", type=click.Choice(["json", "yaml", "trainer-args", "cli"]), default="json", show_default=True,
              help="json/yaml: the config and its measurements; trainer-args: TrainingArguments and model kwargs; "
                   "cli: flags for the Hugging Face example scripts.")
@db_option
def best(study, fmt, db):
    """Print a study's winning configuration for the fine-tune."""
    from autotune.handoff import best as find_best

    chosen = find_best(study, db)
    # On stderr, so that `$(autotune best --format cli)` takes the flags alone.
    if study is None:
        click.echo(f"autotune: the most recent study, {chosen.row.study!r} (--model {chosen.config.model})", err=True)
    if fmt == "cli":
        for caveat in chosen.cli_caveats():
            click.echo(f"autotune: note: {caveat}", err=True)
    click.echo(chosen.render(fmt))


# -- estimate ----------------------------------------------------------------------------------
@cli.command()
@config_options
@click.option("--gpu-budget", default=None, help="Also say whether it fits in this much memory: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.")
@click.option("--safety-margin", default=defaults.SAFETY_MARGIN_TEXT, show_default=True,
              help="Room kept free under the budget: a percentage of it or a size (256MiB).")
@click.option("--device-type", default="cuda", show_default=True,
              help="cuda: predict a GPU run; cpu: predict what a CPU probe accounts.")
@click.option("--timeout", "timeout_text", default=f"{defaults.ESTIMATE_TIMEOUT_SECONDS:.0f}s", show_default=True,
              help="Give up tracing after this long.")
@click.option("--no-cache", is_flag=True, help="Trace again even if this estimate is cached.")
@click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as one JSON object.")
def estimate(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, optimizer, weights, task,
             target_length, num_labels, peft, lora_rank, lora_alpha, lora_dropout, lora_targets, gpu_budget,
             safety_margin, device_type, timeout_text, no_cache, trust_remote_code, as_json):
    """Predict a configuration's training memory without a GPU; with --gpu-budget, exit 1 if it will not fit."""
    from autotune.estimate import estimate_memory
    from autotune.margin import margin_bytes
    from autotune.report import render_estimate
    from autotune.units import parse_duration, parse_margin, parse_size

    budget = parse_size(gpu_budget) if gpu_budget is not None else None
    margin = margin_bytes(parse_margin(safety_margin), budget) if budget is not None else 0
    timeout = parse_duration(timeout_text, flag="--timeout")
    config = make_config(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, task,
                         target_length, num_labels, optimizer, weights,
                         peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets))
    result = estimate_memory(config, device_type=device_type.lower(), timeout=timeout, use_cache=not no_cache,
                             trust_remote_code=trust_remote_code)
    if as_json:
        echo_json(result.to_dict(budget, margin))
    else:
        click.echo(render_estimate(result, budget, margin))
    sys.exit(0 if budget is None or result.fits(budget, margin) else 1)


# -- train -------------------------------------------------------------------------------------
@cli.command()
@click.option("--study", default=None, help="A finished study whose winner to train with [default with --model: MODEL-BUDGET].")
@click.option("--model", default=None, help="Model to train; with --gpu-budget and no finished study for them, a search runs first.")
@click.option("--gpu-budget", default=None,
              help="Memory to fit in (8GiB, 7.5GiB, 8192MiB, 8GB or bytes); with --study alone it overrides the study's budget.")
@click.option("--dataset", required=True,
              help="A local .txt, .json/.jsonl, .csv/.tsv or .parquet file (or directory), or a hub data set NAME[:CONFIG[:SPLIT]].")
@click.option("--text-column", default=None,
              help="Column holding the text (seq2seq: the source) [default: 'text', or the only text column; seq2seq also "
                   "'document', 'article', 'source', 'dialogue', 'input'; classification also 'sentence'].")
@click.option("--target-column", default=None,
              help="seq2seq: column holding the target text [default: 'summary', 'target', 'highlights' or 'output'].")
@click.option("--label-column", default=None,
              help="classification: column holding the labels, text or whole-number ids [default: 'label'].")
@click.option("--eval-split", default=None, help="Evaluation data: a split name, a file, or a share of the blocks held out (5%).")
@click.option("--output-dir", default=None, help="Checkpoints, the model and autotune-run.json [default: ./autotune-runs/STUDY].")
@click.option("--max-steps", type=int, default=None, help="Optimizer steps in all (a resumed run counts the earlier ones).")
@click.option("--epochs", type=float, default=None, help="Passes over the data instead of --max-steps [default: 1].")
@click.option("--device", default=None, help="auto, cpu, cuda or cuda:N [default: the device type the study measured on].")
@click.option("--resume", is_flag=True, help="Go on from the latest checkpoint in --output-dir.")
@click.option("--tokenizer", default=None, help="Tokenizer directory or hub id [default: the model's own].")
@click.option("--learning-rate", type=float, default=5e-5, show_default=True, help="Peak learning rate (linear decay).")
@click.option("--save-steps", type=int, default=500, show_default=True, help="Save a checkpoint every N optimizer steps.")
@click.option("--random-init", is_flag=True, help="Start from random weights even where the model has trained ones.")
@click.option("--merge", is_flag=True,
              help="LoRA: after training, also save the base with the adapters merged in, a whole model, in OUTPUT_DIR/merged.")
@click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the run's summary as one JSON object (progress goes to stderr).")
@task_options
def train(study, model, gpu_budget, dataset, text_column, target_column, label_column, eval_split, output_dir, max_steps,
          epochs, device, resume, tokenizer, learning_rate, save_steps, random_init, merge, trust_remote_code, db, as_json,
          task, target_length, num_labels, peft, lora_rank, lora_alpha, lora_dropout, lora_targets):
    """Train with a study's winning configuration under its budget; exit status 1 if it runs out of memory."""
    from autotune import report
    from autotune.train import TrainOptions
    from autotune.train import train as run
    from autotune.units import parse_size

    budget = parse_size(gpu_budget) if gpu_budget is not None else None
    options = TrainOptions(dataset=dataset, output_dir=output_dir, max_steps=max_steps, epochs=epochs, device=device,
                           text_column=text_column, target_column=target_column, label_column=label_column,
                           eval_split=eval_split, resume=resume, tokenizer=tokenizer,
                           learning_rate=learning_rate, save_steps=save_steps, random_init=random_init, merge=merge,
                           trust_remote_code=trust_remote_code)
    out = sys.stderr if as_json else sys.stdout
    outcome = run(options, study=study, model=model, gpu_budget=budget, task=task, target_length=target_length,
                  num_labels=num_labels, peft=peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets), db=db,
                  echo=lambda line: click.echo(line, file=out),
                  on_search_start=lambda *a: click.echo(report.format_search_header(*a), file=out),
                  on_search_event=lambda e: click.echo(report.format_event(e), file=out))
    if as_json:
        echo_json(outcome.summary.to_dict())
    else:
        click.echo("")
        click.echo(report.render_run_summary(outcome.summary))
    if not outcome.finished:
        click.echo(f"autotune: {outcome.message}", err=True)
        sys.exit(1)
