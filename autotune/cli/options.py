"""Flags shared by several commands, and the objects they make (a config, probe settings)."""

from __future__ import annotations

import math
import re

import click

from autotune import defaults
from autotune.cli.app import (
    ALLOCATOR_HELP,
    DB_HELP,
    DEVICE_HELP,
    LIGER_HELP,
    OPTIMIZER_HELP,
    PACKING_HELP,
    PADDING_FREE_HELP,
    SAMPLING_HELP,
    TRAINER_HELP,
    WEIGHTS_HELP,
)
from autotune.errors import quoted
from autotune.units import INT64_MAX, MAX_STEPS, parse_duration


# -- The kinds of values flags take: one type per kind, one bound each, used by every command --------
# A value is refused where click reads it, before any command body runs: one line, exit status 2,
# nothing looked at or written. Owners of a finer rule (ProbeSettings: at least 2 warm-up steps;
# evaluation: at most 1024 beams) still check it, with its reason.


def _flag(param: click.Parameter | None) -> str:
    return max(param.opts, key=len) if param is not None and param.opts else "the value"


class WholeNumber(click.ParamType):
    """A whole number from `minimum` to `maximum`, in ASCII digits ('1_000', '2.0', '1e3' are refused)."""

    name = "integer"

    def __init__(self, minimum: int, maximum: int, why: str) -> None:
        self.minimum, self.maximum, self.why = minimum, maximum, why

    def convert(self, value, param, ctx):
        flag = _flag(param)
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if not re.fullmatch(r"[+-]?[0-9]+", text, re.ASCII):
                raise click.UsageError(
                    f"{flag} {quoted(value)} is not a whole number; give one from {self.minimum} to {self.maximum}", ctx
                )
            # (Past 4300 digits int() refuses to read it: it is out of range either way.)
            number = int(text) if len(text) <= 400 else (-1 if text.startswith("-") else 1) * 10**400
        if number < self.minimum:
            raise click.UsageError(
                f"{flag} must be a whole number of at least {self.minimum} (got {quoted(number)})", ctx
            )
        if number > self.maximum:
            raise click.UsageError(
                f"{flag} must be a whole number from {self.minimum} to {self.maximum} "
                f"(got {quoted(number)}): {self.why}",
                ctx,
            )
        return number


class Real(click.ParamType):
    """A finite number (nan, inf and 1e309 are refused), above 0 where `positive`, at most `maximum`."""

    name = "float"

    def __init__(self, *, positive: bool = False, maximum: float | None = None, why: str = "") -> None:
        self.positive, self.maximum, self.why = positive, maximum, why

    def convert(self, value, param, ctx):
        flag = _flag(param)
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise click.UsageError(f"{flag} {quoted(value)} is not a finite number; give a number such as 0.5", ctx)
        if self.positive and number <= 0:
            raise click.UsageError(f"{flag} must be above 0 (got {quoted(value)})", ctx)
        if self.maximum is not None and number > self.maximum:
            raise click.UsageError(f"{flag} must be at most {self.maximum} (got {quoted(value)}): {self.why}", ctx)
        return number


class Seconds(click.ParamType):
    """A duration (90, 90s, 15m, 1.5h) read by units.parse_duration: finite, positive (or 0 where
    `allow_zero`), at most MAX_SECONDS. `name` keeps each flag's --help as it was (FLOAT or TEXT)."""

    def __init__(self, name: str, *, allow_zero: bool = False) -> None:
        self.name, self.allow_zero = name, allow_zero

    def convert(self, value, param, ctx):
        from autotune.errors import BadInput

        try:
            return parse_duration(
                value if isinstance(value, float) else str(value).strip(), flag=_flag(param), allow_zero=self.allow_zero
            )
        except BadInput as exc:
            raise click.UsageError(str(exc).rstrip("."), ctx) from None


class Device(click.ParamType):
    """auto, cpu, cuda or cuda:N; cuda only where a CUDA device may be seen (told without torch)."""

    name = "text"

    def convert(self, value, param, ctx):
        from autotune.probe.runner import cuda_may_be_visible

        flag = _flag(param)
        device = str(value).strip().lower()
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", device, re.ASCII):
            raise click.UsageError(f"{flag} {quoted(value)} is not supported; use auto, cpu, cuda or cuda:N", ctx)
        if device.startswith("cuda") and not cuda_may_be_visible():
            raise click.UsageError(
                f"{flag} {device}: no CUDA device can be seen here (no NVIDIA device node, or "
                f"CUDA_VISIBLE_DEVICES hides them all); use --device cpu, or run it where the GPU is",
                ctx,
            )
        return device


class HostPort(click.ParamType):
    """HOST:PORT where torchrun's ranks meet: a host name or address ([::1] in brackets) and a port
    from 1 to 65535 (0 would be any free port, which the other nodes cannot know)."""

    name = "text"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        host, _, port = text.rpartition(":")
        if not (
            re.fullmatch(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]", host, re.ASCII)
            and re.fullmatch(r"[0-9]{1,5}", port, re.ASCII)
            and 1 <= int(port) <= 65535
        ):
            raise click.UsageError(
                f"{_flag(param)} {quoted(value)} is not HOST:PORT with a port from 1 to 65535 (the "
                f"first node's address and a free port, e.g. 10.0.0.1:29500)",
                ctx,
            )
        return text


# Sequences, tokens, labels, ranks, probes, beams: anything counted that reaches the database.
COUNT = WholeNumber(1, INT64_MAX, "the largest whole number the results database stores")
# Optimizer steps: a probe's warm-up and timed steps, a run's steps.
STEPS = WholeNumber(
    1, MAX_STEPS, "more steps than could end within the longest wait the system can set (24 days) at a microsecond each"
)
# A rate or a share (learning rate, dropout, a margin): finite; the flag's owner checks its range.
REAL = Real()
RATE = Real(positive=True)
# Passes over the data: each is at least one optimizer step.
PASSES = Real(positive=True, maximum=MAX_STEPS, why="each pass is at least one step, and steps go up to that")
# A place among counted things that starts at 0 (a node's rank).
INDEX = WholeNumber(0, INT64_MAX, "the largest whole number the results database stores")
DURATION = Seconds("text")  # --timeout, --probe-timeout (90s, 15m)
SECONDS = Seconds("float")  # flags named in seconds (a unit may still be given)
SECONDS_OR_ZERO = Seconds("float", allow_zero=True)
DEVICE = Device()
RENDEZVOUS = HostPort()


def check_cpu_ranks(gpus: int, device: str, *, oversubscribe: bool | None = None) -> None:
    """Refuse more CPU ranks for each probe than this machine runs at once (sharding.cpu_rank_problems,
    the rule --workers follows): on --device cpu, or auto where no CUDA device can be seen."""
    from autotune.errors import BadInput
    from autotune.probe.runner import cuda_may_be_visible
    from autotune.sharding import cpu_rank_problems

    kind = str(device).strip().lower()
    if kind == "cpu" or (kind == "auto" and not cuda_may_be_visible()):
        if problems := cpu_rank_problems(gpus, oversubscribe=oversubscribe):
            raise BadInput("; ".join(problems) + ".")


GPUS_HELP = (
    "Ranks on each node (one GPU each, or one CPU process each on --device cpu) that share the run, "
    "started by torchrun; each holds --micro-batch sequences per micro-step, the budget is each card's."
)
NODES_HELP = (
    "Machines of --gpus ranks each (torchrun's rendezvous at --rendezvous; the others run `autotune node`): "
    "the run has gpus x nodes ranks."
)
STRATEGY_HELP = (
    "How --gpus 2 or more share the run: ddp (a whole copy per rank), fsdp (FSDP2, everything sharded), "
    "fsdp-grad-op (parameters kept gathered from forward to backward), fsdp-offload (sharded state on "
    "the host) [default: ddp]."
)


def config_options(func):
    """The levers of one configuration, shared by `probe` and `estimate`."""
    options = [
        click.option("--model", required=True, help="Hub id, gpt2-family name, or a local directory with config.json."),
        click.option("--micro-batch", type=COUNT, required=True, help="Sequences per forward/backward pass."),
        click.option("--block-size", type=COUNT, required=True, help="Tokens per sequence."),
        click.option("--grad-accum", type=COUNT, default=1, show_default=True, help="Micro-steps per optimizer step."),
        click.option(
            "--precision",
            default=defaults.PRECISION,
            show_default=True,
            help="fp32, fp16 (with a gradient scaler), bf16 (mixed precision) or tf32 (fp32 with TF32 matmuls, CUDA).",
        ),
        click.option(
            "--checkpointing/--no-checkpointing",
            default=False,
            show_default=True,
            help="Gradient (activation) checkpointing.",
        ),
        click.option(
            "--attention",
            default=defaults.ATTENTION,
            show_default=True,
            help="Attention implementation: sdpa, eager, flash_attention_2, ...",
        ),
        click.option("--optimizer", default=defaults.OPTIMIZER, show_default=True, help=OPTIMIZER_HELP),
        click.option("--weights", default="fp32", show_default=True, help=WEIGHTS_HELP),
        click.option(
            "--compile/--no-compile",
            "compile_",
            default=False,
            show_default=True,
            help="torch.compile the model (inductor); its compile time is reported apart from the timing.",
        ),
        click.option("--allocator", default="default", show_default=True, help=ALLOCATOR_HELP),
        click.option("--liger/--no-liger", default=False, show_default=True, help=LIGER_HELP),
        click.option("--trainer", default=None, help=TRAINER_HELP + " [default: transformers]"),
        click.option("--gpus", type=COUNT, default=1, show_default=True, help=GPUS_HELP),
        click.option("--strategy", default=None, help=STRATEGY_HELP),
        click.option("--nodes", type=COUNT, default=1, show_default=True, help=NODES_HELP),
    ]
    for option in reversed(options):
        func = option(func)
    return task_options(func)


def task_options(func):
    """What is trained (recipe levers, never searched), shared by probe, estimate, search and train."""
    from autotune.tasks import TASK_HELP

    options = [
        click.option("--task", default=None, help=f"What is trained: {TASK_HELP}."),
        click.option(
            "--target-length",
            type=COUNT,
            default=None,
            help="seq2seq: target tokens per example, from your data [default: 128, as run_summarization.py].",
        ),
        click.option(
            "--num-labels",
            type=COUNT,
            default=None,
            help="classification: labels of the head [default: the config's id2label, or 2].",
        ),
        click.option(
            "--peft",
            default=None,
            help="lora: LoRA adapters on a frozen base (needs peft); qlora: a 4-bit base "
            "too (CUDA and bitsandbytes) [default: full fine-tuning].",
        ),
        click.option("--lora-rank", type=COUNT, default=None, help="LoRA rank r [default: 8]."),
        click.option("--lora-alpha", type=COUNT, default=None, help="LoRA alpha [default: 16]."),
        click.option("--lora-dropout", type=REAL, default=None, help="LoRA dropout [default: 0.05]."),
        click.option(
            "--lora-targets",
            default=None,
            help="Modules that get adapters: all-linear, or names such as q_proj,v_proj [default: all-linear].",
        ),
        # How the run evaluates (autotune.evaluation): its probes run these phases too.
        click.option(
            "--eval-batch",
            default=None,
            help="Evaluate with this per_device_eval_batch_size, or auto: the largest up to 64 that fits beside "
            "the training state (each probe finds it). Each probe runs eval batches after its training "
            "steps, and fits only if they fit too [default: no evaluation].",
        ),
        click.option(
            "--eval-logits",
            default=None,
            type=click.Choice(["loss-only", "kept"], case_sensitive=False),
            help="What evaluation keeps: loss-only (no compute_metrics), or kept logits (compute_metrics), "
            "held on the card for --eval-accumulation-steps batches [default: loss-only].",
        ),
        click.option(
            "--eval-accumulation-steps",
            type=COUNT,
            default=None,
            help="Eval batches whose kept logits stay on the card before moving to the host (handed off as "
            "eval_accumulation_steps) [default: 1 with --eval-logits kept].",
        ),
        click.option(
            "--generate",
            is_flag=True,
            default=False,
            help="seq2seq: evaluation generates (predict_with_generate): each probe runs generate too.",
        ),
        click.option(
            "--generation-max-length",
            type=COUNT,
            default=None,
            help="--generate: tokens generated, the whole length [default: the target length].",
        ),
        click.option(
            "--num-beams", type=COUNT, default=None, help="--generate: beams of the beam search [default: 1]."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def evaluation_asked(
    eval_batch=None,
    eval_logits=None,
    eval_accumulation_steps=None,
    generate=False,
    generation_max_length=None,
    num_beams=None,
) -> dict:
    """task_options' evaluation flags, as evaluation.recipe_fields reads them."""
    return dict(
        eval_batch=_eval_batch(eval_batch),
        eval_logits=eval_logits.lower() if eval_logits else None,
        eval_accumulation_steps=eval_accumulation_steps,
        generate=generate,
        generation_max_length=generation_max_length,
        num_beams=num_beams,
    )


def _eval_batch(text: str | None) -> int | str | None:
    """--eval-batch: a whole number, or auto."""
    from autotune.evaluation import AUTO

    if text is None or text.strip().lower() == AUTO:
        return None if text is None else AUTO
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither a whole number nor auto", param_hint="--eval-batch") from None


def make_config(
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
    peft=None,
    compile_=False,
    allocator="default",
    liger=False,
    evaluation=None,
    gpus=1,
    strategy=None,
    nodes=1,
    budget_bytes=None,
    trainer=None,
):
    """The one config `probe` and `estimate` are about, checked before any process starts; with
    `budget_bytes`, its tables too (the embedding, a learned position table, a classification head
    of --num-labels: ModelSpec.check_shapes)."""
    from autotune.config import ProbeConfig
    from autotune.models import resolve_model
    from autotune.recipes import DEFAULT_TRAINER
    from autotune.space import single_config

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
        peft=peft,
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
        spec, task=task, target_length=target_length, num_labels=num_labels, evaluation=evaluation, **levers
    )
    spec.check_shapes(budget_bytes, num_labels=config.num_labels)
    say_task_assumed(spec.config, task)
    return config


def say_task_assumed(model_config: dict, task: str | None) -> None:
    """A note on stderr when the task was assumed from the model type (no --task, no head named in
    its config.json): stdout stays the command's answer."""
    from autotune.tasks import task_note

    if (note := task_note(model_config, task)) is not None:
        click.echo(f"autotune: note: {note}", err=True)


def probe_settings_options(func):
    """How probes run, shared by `probe` and `search`."""
    options = [
        click.option("--device", type=DEVICE, default="auto", show_default=True, help=DEVICE_HELP),
        click.option(
            "--safety-margin",
            default=defaults.SAFETY_MARGIN_TEXT,
            show_default=True,
            help="Room kept free under the budget: a percentage of it or a size (256MiB). "
            "A config fits when peak reserved + CUDA context + margin <= budget.",
        ),
        click.option(
            "--warmup-steps",
            type=STEPS,
            default=defaults.WARMUP_STEPS,
            show_default=True,
            help="Optimizer steps before timing (at least 2).",
        ),
        click.option(
            "--measure-steps",
            type=STEPS,
            default=defaults.MEASURE_STEPS,
            show_default=True,
            help="Timed optimizer steps, at least.",
        ),
        click.option(
            "--measure-seconds",
            type=SECONDS_OR_ZERO,
            default=defaults.MEASURE_SECONDS,
            show_default=True,
            help=f"Time steps until the window is at least this long (up to {defaults.MAX_MEASURE_STEPS} steps), "
            f"so that fast configs are timed as steadily as slow ones.",
        ),
        click.option(
            "--probe-timeout",
            type=DURATION,
            default=f"{defaults.PROBE_TIMEOUT_SECONDS:.0f}s",
            show_default=True,
            help="Kill a probe after this long (e.g. 90s, 10m).",
        ),
        click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run."),
        click.option(
            "--max-compile-seconds",
            type=SECONDS,
            default=None,
            help="--compile: skip a config whose compilation takes longer than this [default: no bound].",
        ),
        click.option(
            "--rendezvous",
            type=RENDEZVOUS,
            default=None,
            metavar="HOST:PORT",
            help="With --nodes 2 or more: this node's address and a free port, where torchrun's ranks meet; "
            "start `autotune node --rendezvous HOST:PORT` on each other node.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_settings(
    device,
    safety_margin,
    warmup_steps,
    measure_steps,
    measure_seconds,
    probe_timeout,
    trust_remote_code,
    max_compile_seconds=None,
    rendezvous=None,
):
    from autotune.probe import ProbeSettings
    from autotune.units import parse_duration, parse_margin

    return ProbeSettings(
        device=device,
        margin=parse_margin(safety_margin),
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        measure_seconds=measure_seconds,
        timeout=parse_duration(probe_timeout, flag="--probe-timeout"),
        trust_remote_code=trust_remote_code,
        max_compile_seconds=max_compile_seconds,
        rendezvous=rendezvous,
    )


def db_option(func):
    return click.option("--db", metavar="URL", default=None, help=DB_HELP)(func)


def data_options(*, required: bool):
    """Where the data is and which columns hold what: train's data (`required`), and search's and
    plan's, whose longest example is the longest batch to probe (autotune.data.shape)."""
    what = (
        "A local .txt, .json/.jsonl, .csv/.tsv or .parquet file (or directory), or a hub data set "
        "NAME[:CONFIG[:SPLIT]]."
    )
    if not required:
        what += (
            " Seq2seq and classification: its longest example caps the block sizes and the target length "
            "(no batch of it is longer), and gives a classifier its labels."
        )
    options = [
        click.option("--dataset", required=required, default=None, help=what),
        click.option(
            "--text-column",
            default=None,
            help="Column holding the text (seq2seq: the source) [default: 'text', or the only text column; "
            "seq2seq also 'document', 'article', 'source', 'dialogue', 'input'; classification also "
            "'sentence'].",
        ),
        click.option(
            "--target-column",
            default=None,
            help="seq2seq: column holding the target text [default: 'summary', 'target', 'highlights' or 'output'].",
        ),
        click.option(
            "--label-column",
            default=None,
            help="classification: column holding the labels, text or whole-number ids [default: 'label'].",
        ),
        click.option("--tokenizer", default=None, help="Tokenizer directory or hub id [default: the model's own]."),
    ]

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def data_arguments(dataset, text_column, target_column, label_column, tokenizer):
    """data_options' flags as the DataOptions of search and plan (None without --dataset); a column
    flag without --dataset is a mistake."""
    from autotune.data.options import DataOptions

    if dataset is None:
        for flag, value in (
            ("--text-column", text_column),
            ("--target-column", target_column),
            ("--label-column", label_column),
            ("--tokenizer", tokenizer),
        ):
            if value is not None:
                raise click.UsageError(f"{flag} describes the data: give --dataset too, or leave {flag} out")
        return None
    return DataOptions(dataset, text_column, target_column, label_column, tokenizer=tokenizer)


def space_options(func):
    """The search space's flags, shared by `search` and `plan`; the recipe levers come with them."""
    options = [
        click.option(
            "--effective-batch",
            type=COUNT,
            default=None,
            help="Sequences per optimizer step, kept fixed; accumulation = effective batch / micro-batch "
            f"[default: {defaults.EFFECTIVE_BATCH}].",
        ),
        click.option(
            "--effective-tokens",
            type=COUNT,
            default=None,
            help=f"Tokens per optimizer step, for several --block-sizes [default: {defaults.EFFECTIVE_BATCH} x the largest block].",
        ),
        click.option(
            "--micro-batches",
            default=None,
            help=f"Micro-batches to try [default: {','.join(map(str, defaults.MICRO_BATCHES))} up to the effective batch].",
        ),
        click.option(
            "--block-sizes",
            default=None,
            help=f"Block sizes to try [default: {defaults.BLOCK_SIZE}, or the model's maximum if smaller].",
        ),
        click.option(
            "--precisions", default=",".join(defaults.PRECISIONS), show_default=True, help="Precisions to try."
        ),
        click.option(
            "--checkpointing",
            "checkpointing_",
            default=",".join("on" if c else "off" for c in defaults.CHECKPOINTING),
            show_default=True,
            help="Gradient checkpointing: on, off or both.",
        ),
        click.option(
            "--attention",
            default=",".join(defaults.ATTENTIONS),
            show_default=True,
            help="Attention implementations to try.",
        ),
        click.option(
            "--optimizers",
            default=defaults.OPTIMIZER,
            show_default=True,
            help="Optimizers the search may choose among (a recipe lever: list only those you accept): "
            + OPTIMIZER_HELP,
        ),
        click.option(
            "--weights",
            "weights_",
            default="fp32",
            show_default=True,
            help="Weights dtypes the search may choose among (fp32, bf16: a recipe lever).",
        ),
        click.option(
            "--compile",
            "compile_",
            default="off",
            show_default=True,
            help="torch.compile: off, on, or off,on to let the search choose (compile time is reported apart).",
        ),
        click.option(
            "--allocators",
            default="default",
            show_default=True,
            help="CUDA allocator settings to try: default, expandable (expandable_segments:True), or both.",
        ),
        click.option(
            "--liger", default="off", show_default=True, help="Liger's kernels (CUDA, liger-kernel): off, on or off,on."
        ),
        click.option(
            "--trainer", default=None, help=TRAINER_HELP + " [default: transformers, or the --from file's tool]"
        ),
        click.option("--packing", default=None, help=PACKING_HELP + " [default: on, or the --from file's]"),
        click.option("--sampling", default=None, help=SAMPLING_HELP + " [default: random, or the --from file's]"),
        click.option("--padding-free", default=None, help=PADDING_FREE_HELP + " [default: off, or the --from file's]"),
        click.option("--gpus", type=COUNT, default=1, show_default=True, help=GPUS_HELP),
        click.option("--nodes", type=COUNT, default=1, show_default=True, help=NODES_HELP),
        click.option(
            "--strategies",
            default=None,
            help="With --gpus 2 or more: how the ranks may share the run, among ddp, fsdp, fsdp-grad-op and "
            "fsdp-offload (they keep the math: searched) [default: all four].",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return data_options(required=False)(task_options(func))


def on_off_list(text: str, flag: str) -> tuple[bool, ...]:
    """'off', 'on' or 'off,on' (true/false too) as the booleans a space holds, in the order given."""
    from autotune.units import parse_choice_list

    values = parse_choice_list(text, flag=flag, allowed=("off", "on", "false", "true"))
    return tuple(dict.fromkeys(v in ("on", "true") for v in values))


def one_on_off(text: str | None, flag: str) -> bool | None:
    """'on' or 'off' (true/false too) as one boolean; None when not given."""
    if text is None:
        return None
    values = on_off_list(text, flag)
    if len(values) != 1:
        raise click.BadParameter("give on or off, not both: it is a recipe lever, fixed for the study", param_hint=flag)
    return values[0]


def space_arguments(
    *,
    micro_batches,
    block_sizes,
    precisions,
    checkpointing_,
    attention,
    optimizers,
    weights_,
    compile_,
    allocators,
    liger,
    trainer,
    effective_batch,
    effective_tokens,
    task,
    target_length,
    num_labels,
    peft,
    lora_rank,
    lora_alpha,
    lora_dropout,
    lora_targets,
    packing=None,
    sampling=None,
    padding_free=None,
    eval_batch=None,
    eval_logits=None,
    eval_accumulation_steps=None,
    generate=False,
    generation_max_length=None,
    num_beams=None,
    gpus=1,
    strategies=None,
    nodes=1,
    dataset=None,
    text_column=None,
    target_column=None,
    label_column=None,
    tokenizer=None,
) -> dict:
    """space_options' flags, parsed, as SearchSpace.build's keyword arguments."""
    from autotune.config import ATTENTIONS, OPTIMIZERS, PRECISIONS
    from autotune.lengths import SAMPLINGS
    from autotune.recipes import OPTIMIZER_ALIASES, WEIGHTS, peft_text
    from autotune.sharding import STRATEGIES
    from autotune.speed import ALLOCATORS
    from autotune.units import parse_choice_list, parse_int_list

    for flag, value in (("--effective-batch", effective_batch), ("--effective-tokens", effective_tokens)):
        if value is not None and value < 1:
            raise click.BadParameter(f"must be at least 1 (got {value})", param_hint=flag)
    return dict(
        micro_batches=parse_int_list(micro_batches, flag="--micro-batches") if micro_batches is not None else None,
        block_sizes=parse_int_list(block_sizes, flag="--block-sizes") if block_sizes is not None else None,
        precisions=parse_choice_list(precisions, flag="--precisions", allowed=PRECISIONS),
        checkpointing=on_off_list(checkpointing_, "--checkpointing"),
        attentions=parse_choice_list(attention, flag="--attention", allowed=ATTENTIONS),
        effective_batch=effective_batch,
        effective_tokens=effective_tokens,
        task=task,
        target_length=target_length,
        num_labels=num_labels,
        # (Trainer's names too: SearchSpace.build stores each under autotune's)
        optimizers=parse_choice_list(optimizers, flag="--optimizers", allowed=(*OPTIMIZERS, *OPTIMIZER_ALIASES)),
        weights=parse_choice_list(weights_, flag="--weights", allowed=WEIGHTS),
        peft=peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets),
        trainer=trainer.strip().lower() if trainer else None,
        packing=one_on_off(packing, "--packing"),
        samplings=parse_choice_list(sampling, flag="--sampling", allowed=SAMPLINGS) if sampling is not None else None,
        padding_frees=on_off_list(padding_free, "--padding-free") if padding_free is not None else None,
        compiles=on_off_list(compile_, "--compile"),
        allocators=parse_choice_list(allocators, flag="--allocators", allowed=tuple(ALLOCATORS)),
        ligers=on_off_list(liger, "--liger"),
        evaluation=evaluation_asked(
            eval_batch, eval_logits, eval_accumulation_steps, generate, generation_max_length, num_beams
        ),
        gpus=gpus,
        nodes=nodes,
        strategies=parse_choice_list(strategies, flag="--strategies", allowed=STRATEGIES)
        if strategies is not None
        else None,
        data=data_arguments(dataset, text_column, target_column, label_column, tokenizer),
    )
