"""The run itself: the winner's TrainingArguments, `transformers.Trainer` inside the enforced
budget, checkpoints and the output directory, and the `RunSummary` of what happened, stored and
written whether the run finished or not. transformers is imported once a run starts."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autotune.vocabulary.defaults import ERROR_TAIL_CHARS, WARMUP_STEPS
from autotune.vocabulary.errors import BadInput
from autotune.levers.evaluation import EVAL, GENERATE, KEPT, evaluates, generates
from autotune.handoff.later_phases import generate_with_cache
from autotune.handoff.loss_scaling import fix_loss_scaling
from autotune.levers.recipes import OPTIMIZERS
from autotune.vocabulary.status import ProbeStatus, RunEnd
from autotune.train.options import TrainOptions, TrainOutcome
from autotune.train.summary import ProbeMeasurement, RunSummary
from autotune.train.winner import Winner
from autotune.vocabulary.units import format_size

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments

    from autotune.levers.config import ProbeConfig
    from autotune.data import Blocks
    from autotune.specs.models import ModelSpec
    from autotune.probe.cap import MemoryCap
    from autotune.store import Store
    from autotune.train.meter import RunMeter
    from autotune.data.task_data import Examples, Labels

DEFAULT_OUTPUT_ROOT = "autotune-runs"
MERGED_DIR = "merged"  # --merge: <output_dir>/merged holds the base with the LoRA adapters merged in
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def default_output_dir(study: str) -> Path:
    """./autotune-runs/<study>, the study's name made safe for a directory: one plain path part,
    never `.`, `..` or empty, even for a name stored by an older autotune that allowed any name
    (`..` would put the model in the working directory)."""
    part = re.sub(r"[^A-Za-z0-9._-]+", "_", study)
    if not part.strip("."):
        part = part.replace(".", "_") or "_"
    return Path(DEFAULT_OUTPUT_ROOT) / part


def checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Trainer's checkpoint directories in `output_dir`, oldest step first."""
    path = Path(output_dir)
    if not path.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in path.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def check_optimizer_available(config: ProbeConfig, device: torch.device) -> None:
    """BadInput, before the run is recorded, for a winner's optimizer that cannot run here (Trainer
    would fail only once the run started)."""
    optimizer = OPTIMIZERS[config.optimizer]
    if optimizer.needs is not None and importlib.util.find_spec(optimizer.needs) is None:
        raise BadInput(
            f"the winner's optimizer {config.optimizer} needs {optimizer.needs}: pip install {optimizer.needs}, "
            f"or search again without it in --optimizers under a new --study name."
        )
    if optimizer.optim.startswith("paged") and device.type != "cuda":
        raise BadInput(
            f"the winner's optimizer {config.optimizer} pages its state through CUDA memory: train on a CUDA "
            f"device, or search again without it in --optimizers under a new --study name."
        )


def training_arguments(
    winner: Winner, options: TrainOptions, output_dir: Path, device: torch.device, has_eval: bool
) -> TrainingArguments:
    """The hand-off's TrainingArguments for the winner, with this run's length, saving and logging. The
    hand-off carries the recipe the probe measured: the optimizer as Trainer's `optim` (and
    `optim_args`), bf16=True only for --precision bf16 (pure bf16 weights with fp32 precision
    train without an autocast flag; the weights' dtype is the model's, autotune.train.loading), and
    the evaluation its probe ran (the eval batch, the one it found for --eval-batch auto, loss only
    or logits kept for eval_accumulation_steps, Seq2SeqTrainingArguments' generation:
    `BestConfig.eval_kwargs`).

    With evaluation data the run evaluates every `save_steps` optimizer steps, at its checkpoints,
    and at its end (Trainer's DefaultFlowCallback adds the last step): the first evaluation comes
    with the optimizer state resident, as in the probe, and the end one gives the final eval loss.
    A winner whose probe ran no evaluation evaluates as autotune train always did, at its
    micro-batch with the loss only: memory no probe measured (said in the run's warnings)."""
    from autotune.handoff import BestConfig

    config = winner.row.config
    check_optimizer_available(config, device)
    logging_steps = options.logging_steps or (max(1, min(50, options.max_steps // 10)) if options.max_steps else 50)
    overrides: dict[str, Any] = {
        "max_steps": options.max_steps or -1,
        "num_train_epochs": options.epochs or 1.0,
        "learning_rate": options.learning_rate,
        "save_strategy": "steps",
        "save_steps": options.save_steps,
        "logging_steps": logging_steps,
        "logging_first_step": True,
        "report_to": "none",
        "disable_tqdm": not sys.stderr.isatty(),
        "use_cpu": device.type == "cpu",
        "dataloader_pin_memory": device.type == "cuda",
        "seed": options.seed,
    }
    if not evaluates(config):
        # An evaluation keeps losses, not every logit, in batches the training step is known to hold.
        overrides.update(per_device_eval_batch_size=config.micro_batch, prediction_loss_only=True)
    if has_eval:
        overrides.update(eval_strategy="steps", eval_steps=options.save_steps)
    try:
        return BestConfig(winner.row, device.type).training_arguments(str(output_dir), **overrides)
    except (ValueError, ImportError) as exc:
        raise BadInput(
            f"transformers cannot train {config.label()} on {device}: {' '.join(str(exc).split())[:300]}"
        ) from None


def describe_limits(limits: MemoryCap, device_name: str) -> str:
    """One line on how the budget is held on this device."""
    if limits.device.type == "cuda":
        return (
            f"device: {device_name}; budget {format_size(limits.budget.total_bytes)}: allocator capped at "
            f"{format_size(limits.cap_bytes)} (CUDA context {format_size(limits.context_bytes)}, margin "
            f"{format_size(limits.budget.margin_bytes)})"
        )
    return (
        f"device: {device_name}; budget {format_size(limits.budget.total_bytes)}: memory accountant capped at "
        f"{format_size(limits.cap_bytes)} (margin {format_size(limits.budget.margin_bytes)}); it counts every tensor "
        f"of the first {WARMUP_STEPS} steps and of each evaluation (the steps between repeat them and run "
        f"without it, as the probe's timed window did)"
    )


@dataclass(slots=True)
class RunContext:
    """Everything checked before the run was recorded, which the run and its summary need."""

    spec: ModelSpec
    winner: Winner
    options: TrainOptions
    output_dir: Path
    blocks: Blocks | Examples
    limits: MemoryCap
    weights: str | None
    resume_from: str | None
    warnings: list[str]
    searched: bool
    labels: Labels | None = None  # a classifier's, from the data


class Recorder(Protocol):
    """Where a run's end is kept (StoreRecorder; a rank's: autotune.train.ranks.RankRecorder)."""

    def alive(self) -> contextlib.AbstractContextManager: ...

    def failed(self, error: str, summary: RunSummary) -> None: ...

    def interrupted(self, summary: RunSummary) -> None: ...

    def out_of_memory(self, failure: str, summary: RunSummary) -> None: ...

    def finished(self, summary: RunSummary) -> None: ...


class StoreRecorder:
    """How a run's end is kept: its row in the store (recorded as running before it started) and
    autotune-run.json in its output directory. A rank of a run on several GPUs keeps its end
    otherwise (autotune.train.ranks); the process that started the ranks keeps the run's here."""

    def __init__(self, store: Store, run_id: int, output_dir: Path) -> None:
        self.store, self.run_id, self.output_dir = store, run_id, output_dir

    def alive(self) -> contextlib.AbstractContextManager:
        return beating(self.store, self.run_id)

    def failed(self, error: str, summary: RunSummary) -> None:
        self.store.runs.fail(self.run_id, error, summary=summary.to_dict())

    def interrupted(self, summary: RunSummary) -> None:
        self.store.runs.interrupt(self.run_id, summary=summary.to_dict())

    def out_of_memory(self, failure: str, summary: RunSummary) -> None:
        self.store.runs.fail(self.run_id, f"out of memory: {failure}", summary=summary.to_dict())
        summary.write(self.output_dir)

    def finished(self, summary: RunSummary) -> None:
        self.store.runs.finish(
            self.run_id,
            steps=summary.steps,
            tokens_per_s=summary.tokens_per_s,
            peak_allocated_bytes=summary.peak_allocated_bytes,
            peak_reserved_bytes=summary.peak_reserved_bytes,
            final_loss=summary.final_loss,
            summary=summary.to_dict(),
        )
        summary.write(self.output_dir)


def run_training(
    ctx: RunContext,
    run_id: int,
    recorder: Recorder,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    echo: Callable[[str], None],
) -> TrainOutcome:
    """Train run `run_id` (already recorded as running) and keep how it ended (`recorder`). An OOM
    is an outcome (`status='oom'`, checkpoints kept); any other failure is kept and raised."""

    from autotune.probe.oom import classify_exception
    from autotune.train.meter import RunMeter

    config, limits = ctx.winner.row.config, ctx.limits
    quiet = bool(args.disable_tqdm)  # no terminal: no progress bars, log lines through `echo` instead
    # A generating evaluation is the probe's generate phase (generate, then the loss forward, on
    # each eval batch); a run has no other evaluation then.
    meter = RunMeter(
        limits, config.tokens_per_step, echo if quiet else None, eval_phase=GENERATE if generates(config) else EVAL
    )
    trainer: Trainer | None = None
    model: PreTrainedModel | None = None
    started = time.perf_counter()
    metrics: dict[str, Any] = {}
    failure: str | None = None

    def summarize(status: RunEnd, error: str | None) -> RunSummary:
        return _summarize(ctx, run_id, status, meter, trainer, metrics, started, error)

    try:
        with limits.guard(), _quiet_bars(quiet), recorder.alive():
            # Built inside the guard: on CPU the accountant must see the weights born.
            model = _built_model(ctx, tokenizer, echo)
            trainer = _trainer(ctx, model, args, tokenizer, meter, quiet)
            output = trainer.train(resume_from_checkpoint=ctx.resume_from)
            metrics.update(output.metrics)
            if ctx.blocks.eval is not None and meter.evaluated_at != trainer.state.global_step:
                # (Trainer evaluates at the last step itself; not when a resumed run had no step left.)
                metrics.update(trainer.evaluate())
            meter.read_peaks()
    except Exception as exc:
        meter.read_peaks()
        if classify_exception(exc) != ProbeStatus.OOM:
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-ERROR_TAIL_CHARS:]
            if disk_full(exc):  # (a checkpoint being saved, most often): the user's to fix, not a bug
                return _ended_disk_full(
                    ctx,
                    run_id,
                    recorder,
                    text,
                    summarize(RunEnd.ERROR, text),
                    trainer.state.global_step if trainer is not None else 0,
                )
            recorder.failed(text, summarize(RunEnd.ERROR, text))
            raise
        failure = " ".join(str(exc).split())[:ERROR_TAIL_CHARS]
        del exc  # its traceback holds the failing frames and their tensors
    except BaseException:  # Ctrl-C, SIGTERM: the run did not finish; say so, keep the checkpoints
        recorder.interrupted(summarize(RunEnd.INTERRUPTED, None))
        raise

    if failure is not None:
        step = trainer.state.global_step if trainer is not None else 0
        summary = summarize(RunEnd.OOM, failure)
        trainer = model = None  # (the references dropped before the memory is released)
        return _ended_out_of_memory(ctx, run_id, recorder, step, failure, summary)

    assert trainer is not None and model is not None  # set before training, and training did not fail
    merged_dir: Path | None = None
    with _quiet_bars(quiet):
        # A PeftModel saves its adapters alone (adapter_config.json, adapter_model.safetensors).
        trainer.save_model(str(ctx.output_dir))  # (every rank takes part: FSDP gathers the weights)
        if trainer.is_world_process_zero():
            tokenizer.save_pretrained(str(ctx.output_dir))
        if config.peft is not None:
            echo(
                f"saved: LoRA adapters in {ctx.output_dir} (load them with peft.PeftModel.from_pretrained(base model, "
                f"that directory))"
            )
            if ctx.options.merge:
                merged_dir = save_merged(model, tokenizer, ctx.output_dir / MERGED_DIR)
                echo(f"merged: the base with the adapters merged in, a whole model, saved in {merged_dir}")
    summary = summarize(RunEnd.FINISHED, None)
    if merged_dir is not None:
        summary = replace(summary, merged_dir=str(merged_dir.resolve()))
    recorder.finished(summary)
    trainer = model = None  # (the references dropped before the memory is released)
    limits.release()
    return TrainOutcome(
        RunEnd.FINISHED,
        run_id,
        ctx.winner.study.name,
        str(ctx.output_dir),
        summary,
        None,
        list(summary.warnings),
        ctx.searched,
    )


def _built_model(ctx: RunContext, tokenizer: PreTrainedTokenizerBase, echo: Callable[[str], None]) -> PreTrainedModel:
    """The winner's model as the run trains it (weights loaded where there are some), said."""
    from autotune.train.loading import build_model

    config, limits = ctx.winner.row.config, ctx.limits
    model = build_model(
        ctx.spec,
        config,
        limits.device,
        ctx.weights,
        ctx.options.trust_remote_code,
        labels=ctx.labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    if limits.accountant is not None:
        # Weights read by from_pretrained come from safetensors without passing through the
        # dispatcher; a probe's from_config build is seen, and the two must compare.
        limits.accountant.adopt(model)
    generate_with_cache(model, config)
    how = f"weights from {ctx.weights}" if ctx.weights else "random initialisation from its config (no weights found)"
    echo(f"model: {ctx.spec.reference} ({type(model).__name__}): {how}")
    if config.peft is not None:
        echo(f"adapters: {config.peft}; {describe_trainable(model)}")
    return model


def _trainer(
    ctx: RunContext,
    model: PreTrainedModel,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    meter: RunMeter,
    quiet: bool,
) -> Trainer:
    """Trainer (Seq2SeqTrainer where the evaluation generates), with the meter, the metrics that
    make Trainer keep what the probe kept, and the accumulation's loss scaling right for every model
    (autotune.handoff.loss_scaling)."""
    from transformers import PrinterCallback, Seq2SeqTrainingArguments

    from autotune.train.meter import MeteredSeq2SeqTrainer, MeteredTrainer
    from autotune.data.task_data import task_collator, task_metrics

    config = ctx.winner.row.config
    # Trainer.evaluate keeps the logits (or generates) only when it has a compute_metrics: a run
    # whose probe kept them, or generated, must have one; a loss-only run must not.
    keeps = ctx.blocks.eval is not None and (config.eval_logits == KEPT or generates(config))
    cls = MeteredSeq2SeqTrainer if isinstance(args, Seq2SeqTrainingArguments) else MeteredTrainer
    fix_loss_scaling(model)  # as the hand-off's load_model does: the loss right under accumulation
    trainer = cls(
        model=model,
        args=args,
        train_dataset=ctx.blocks.train,
        eval_dataset=ctx.blocks.eval,
        processing_class=tokenizer,
        data_collator=task_collator(config.task, tokenizer, config.lengths is not None, config.padding_free),
        meter=meter,
        compute_metrics=task_metrics(config, tokenizer) if keeps else None,
    )
    if quiet:
        trainer.remove_callback(PrinterCallback)  # the meter prints log lines through `echo`
    return trainer


def _ended_out_of_memory(
    ctx: RunContext, run_id: int, recorder: Recorder, step: int, failure: str, summary: RunSummary
) -> TrainOutcome:
    """An out-of-memory run: an outcome, recorded with the checkpoints it kept, not an error."""
    config, limits = ctx.winner.row.config, ctx.limits
    kept = checkpoints(ctx.output_dir)
    where = f" in its {summary.failed_phase} phase" if summary.failed_phase is not None else ""
    message = (
        f"out of memory at step {step}{where}: {config.label()} needed more than the {format_size(limits.cap_bytes)} that "
        f"the {format_size(limits.budget.total_bytes)} budget leaves (after context and margin); run #{run_id} "
        f"is marked failed"
        + (f", checkpoints kept in {ctx.output_dir} ({kept[-1].name} is the latest)" if kept else "")
    )
    summary = replace(summary, message=message)
    recorder.out_of_memory(failure, summary)
    limits.release()
    return TrainOutcome(
        RunEnd.OOM,
        run_id,
        ctx.winner.study.name,
        str(ctx.output_dir),
        summary,
        message,
        list(ctx.warnings),
        ctx.searched,
    )


def disk_full(exc: BaseException) -> bool:
    """A write that failed for want of space (ENOSPC, EDQUOT), as the OSError itself or as torch's
    serializer words it ("file write failed", from a PytorchStreamWriter), anywhere in its chain."""
    import errno

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        low = str(seen).lower()
        if "no space left on device" in low or "disk quota exceeded" in low or "file write failed" in low:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _ended_disk_full(
    ctx: RunContext, run_id: int, recorder: Recorder, failure: str, summary: RunSummary, step: int
) -> TrainOutcome:
    """A run whose disk filled (saving a checkpoint): marked failed, the checkpoints saved whole
    before kept, said in one line; --resume goes on from the latest once there is room."""
    kept = checkpoints(ctx.output_dir)
    message = (
        f"the disk under {ctx.output_dir} filled at step {step} (saving a checkpoint?): {failure.splitlines()[-1]}; "
        f"run #{run_id} is marked failed"
        + (
            f", checkpoints kept ({kept[-1].name} is the latest): free some space "
            f"and run the same command with --resume"
            if kept
            else ": free some space and run the same command again"
        )
    )
    summary = replace(summary, message=message)
    recorder.failed(failure, summary)
    ctx.limits.release()
    return TrainOutcome(
        RunEnd.ERROR,
        run_id,
        ctx.winner.study.name,
        str(ctx.output_dir),
        summary,
        message,
        list(ctx.warnings),
        ctx.searched,
    )


@contextlib.contextmanager
def beating(store: Store, run_id: int) -> Iterator[None]:
    """The run's heartbeat while it trains, from a thread: a run whose process is gone (kill -9, a
    lost machine) stops beating and reads as interrupted (autotune/store/liveness.py)."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    from autotune.vocabulary.errors import DatabaseError
    from autotune.store.liveness import RUN_HEARTBEAT_SECONDS

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(RUN_HEARTBEAT_SECONDS):
            # A missed beat is not fatal: the run reads as gone only after several.
            with contextlib.suppress(OperationalError, InterfaceError, DatabaseError):
                store.runs.beat(run_id)

    thread = threading.Thread(target=beat, name="autotune-run-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def describe_trainable(model: PreTrainedModel) -> str:
    """'N of M parameters train (P%)': a LoRA run's adapters (and a classifier's head) against all."""
    from autotune.probe.step import parameter_count

    trainable, total = parameter_count(model, trainable=True), parameter_count(model)
    return f"{trainable:,} of {total:,} parameters train ({100 * trainable / max(total, 1):.2g}%)"


def save_merged(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> Path:
    """--merge: the LoRA adapters of `model` (a PeftModel) merged into its base, saved with the
    tokenizer as a whole model that the task's Auto class loads without peft. After the adapters
    are saved: merging replaces the adapter layers of `model` in place."""
    from peft import PeftModel

    assert isinstance(model, PeftModel)  # build_model wraps the base of a LoRA config
    merged = model.merge_and_unload()
    merged.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@contextlib.contextmanager
def _quiet_bars(quiet: bool) -> Iterator[None]:
    """Without a terminal, transformers' loading and saving bars are noise in a log."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    if quiet and enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and enabled:
            hf_logging.enable_progress_bar()


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _summarize(
    ctx: RunContext,
    run_id: int,
    status: RunEnd,
    meter: RunMeter,
    trainer: Trainer | None,
    metrics: dict[str, Any],
    started: float,
    error: str | None,
) -> RunSummary:
    """The run so far, from the meter, the Trainer's state and its metrics."""
    from autotune.handoff import BestConfig

    row, record, limits = ctx.winner.row, ctx.winner.study, ctx.limits
    config = row.config
    state = trainer.state if trainer is not None else None
    steps = state.global_step if state is not None else 0
    first = meter.first_step if meter.first_step is not None else steps
    runtime = metrics.get("train_runtime")
    on_study_device = limits.device.type == record.environment.get("device_type")
    summary = RunSummary(
        status=status,
        run_id=run_id,
        study=record.name,
        probe_id=row.probe_id,
        model=ctx.spec.reference,
        weights=ctx.weights or "random-init",
        dataset=ctx.options.dataset,
        output_dir=str(ctx.output_dir.resolve()),
        device=record.device_name if on_study_device else str(limits.device),
        device_type=limits.device.type,
        config=config,
        training_arguments=BestConfig(row, limits.device.type).trainer_kwargs(),
        train_blocks=len(ctx.blocks.train),
        eval_blocks=len(ctx.blocks.eval) if ctx.blocks.eval is not None else None,
        resumed_from=ctx.resume_from,
        steps=steps,
        steps_this_run=max(0, steps - first) if state is not None else 0,
        max_steps=state.max_steps if state is not None else ctx.options.max_steps,
        tokens_per_s=_finite(meter.tokens_per_s),
        wall_tokens_per_s=(meter.steps * config.tokens_per_step / runtime) if runtime else None,
        train_seconds=runtime,
        seconds=time.perf_counter() - started,
        budget_bytes=limits.budget.total_bytes,
        margin_bytes=limits.budget.margin_bytes,
        cap_bytes=limits.cap_bytes,
        # Kernels load lazily and grow the context during the run: a finished run measures it again.
        context_bytes=limits.context_now() if status == RunEnd.FINISHED else limits.context_bytes,
        peak_allocated_bytes=meter.peak_allocated,
        peak_reserved_bytes=meter.peak_reserved,
        phase_peaks=meter.phase_peaks,
        failed_phase=meter.failed_phase if status != RunEnd.FINISHED else None,
        probe=ProbeMeasurement.of(row),
        final_loss=_finite(meter.last_loss if meter.last_loss is not None else metrics.get("train_loss")),
        eval_loss=_finite(meter.eval_loss if meter.eval_loss is not None else metrics.get("eval_loss")),
        warnings=tuple(ctx.warnings),
        error=error,
    )
    return summary.with_warnings()
