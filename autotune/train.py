"""`autotune train`: the real fine-tune with a study's winning configuration, run under the same
memory budget as the probes that chose it, so that finishing is the proof that it fits.

    from autotune.train import TrainOptions, train
    outcome = train(TrainOptions(dataset="corpus.txt", max_steps=1000), study="gpt2-8GiB")
    outcome.status, outcome.summary["peak_reserved_bytes"], outcome.summary["tokens_per_s"]

The winner's levers go to `transformers.Trainer` (micro-batch, accumulation, fp16/bf16, gradient
checkpointing) and to the model (attention implementation, `use_cache=False`); the data is packed
into blocks of the winner's block size (`autotune.data`). The budget holds as it does for a probe:
on CUDA the caching allocator is capped at budget - context - margin before the model is built;
on CPU the model is built and trained inside `CpuMemoryAccountant`, which raises
`torch.OutOfMemoryError` past the cap exactly where a card of that size would (at about 40% of
the speed). The run is stored beside the probe that chose it, with its peaks and throughput.

Everything a user can get wrong (study, model, tokenizer, data, device, budget, output directory)
is checked before the run is recorded; an OOM during the run is an outcome (`status='oom'`), the
run marked failed and its checkpoints kept.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import BadInput, BudgetError, DeviceError, ModelNotFound, StudyNotFound
from autotune.units import format_size

if TYPE_CHECKING:
    import torch

    from autotune.data import Blocks
    from autotune.models import ModelSpec
    from autotune.store import LeaderboardRow, Store, StudyRecord
    from autotune.probe.budget import EnforcedBudget

SUMMARY_FILE = "autotune-run.json"
DEFAULT_OUTPUT_ROOT = "autotune-runs"
# A run's peak this far above its probe's is reported: the probe missed something the run holds.
PEAK_TOLERANCE = 0.05
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_ERROR_TAIL = 2000


@dataclass(frozen=True, slots=True)
class TrainOptions:
    """How to train, as opposed to what (the study's winner)."""

    dataset: str
    output_dir: str | None = None          # default: ./autotune-runs/<study>
    max_steps: int | None = None           # optimizer steps in all (a resumed run counts earlier ones)
    epochs: float | None = None            # default: 1 epoch when max_steps is not given
    device: str | None = None              # default: the device type the study measured on
    text_column: str | None = None
    eval_split: str | None = None          # a split name, a file, or a share of the blocks ('5%')
    resume: bool = False
    tokenizer: str | None = None           # default: the model reference's own
    learning_rate: float = 5e-5
    save_steps: int = 500
    logging_steps: int | None = None       # default: a tenth of max_steps, at most 50
    random_init: bool = False              # ignore weights the model reference has
    trust_remote_code: bool = False
    seed: int = 42

    def __post_init__(self) -> None:
        problems = []
        if self.max_steps is not None and self.epochs is not None:
            problems.append("--max-steps and --epochs both given; choose one")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"--max-steps must be at least 1 (got {self.max_steps})")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            problems.append(f"--epochs must be positive (got {self.epochs})")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            problems.append(f"--learning-rate must be positive (got {self.learning_rate})")
        if self.save_steps < 1:
            problems.append(f"--save-steps must be at least 1 (got {self.save_steps})")
        if self.logging_steps is not None and self.logging_steps < 1:
            problems.append(f"--logging-steps must be at least 1 (got {self.logging_steps})")
        if problems:
            raise BadInput("; ".join(problems) + ".")


@dataclass(slots=True)
class TrainOutcome:
    """What a run did. `status` is 'finished' or 'oom'; the summary is what autotune-run.json holds."""

    status: str
    run_id: int
    study: str
    output_dir: str
    summary: dict[str, Any]
    message: str | None = None             # why the run stopped, when it did not finish
    warnings: list[str] = field(default_factory=list)
    searched: bool = False                 # a search ran first to choose the configuration

    @property
    def finished(self) -> bool:
        return self.status == "finished"


# -- the winner --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Winner:
    study: StudyRecord
    row: LeaderboardRow


def _winner(store: Store, name: str | None) -> _Winner:
    study = store.study(name)
    rows = store.leaderboard(study.name, top=1)
    if not rows:
        raise StudyNotFound(f"study {study.name!r} has no configuration that fits its {format_size(study.budget_bytes)} "
                            f"budget; search again with a larger --gpu-budget (or pass --model and --gpu-budget to train "
                            f"searches first).")
    return _Winner(study, rows[0])


def _settled_winner(store: Store, name: str, spec: ModelSpec, budget: int) -> _Winner | None:
    """The winner of a finished study of this model and budget, or None (the search must run)."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    if study.status != "finished" or study.model_fingerprint != spec.fingerprint or study.budget_bytes != budget:
        return None
    rows = store.leaderboard(name, top=1)
    return _Winner(study, rows[0]) if rows else None


def _study_model(winner: _Winner, model: str | None) -> ModelSpec:
    """The model the study measured: `model` when given (it must be the same architecture), else
    the study's own reference."""
    from autotune.models import resolve_model

    study = winner.study
    if model is None:
        try:
            return resolve_model(study.model_reference)
        except ModelNotFound:
            raise ModelNotFound(f"study {study.name!r} measured model {study.model_reference!r}, which cannot be "
                                f"found from here; pass --model with its directory or hub id.") from None
    spec = resolve_model(model)
    if spec.fingerprint != study.model_fingerprint:
        raise BadInput(f"--model {model} is not the architecture study {study.name!r} measured "
                       f"({study.model_reference}); pass that model, or search for this one.")
    return spec


# -- model and tokenizer -----------------------------------------------------------------------
def _hub_usable() -> bool:
    from autotune.models import _hub_reachable, _offline

    return not _offline() and _hub_reachable()


def weights_location(spec: ModelSpec, random_init: bool = False) -> str | None:
    """Where pretrained weights can be loaded from, or None for a random initialisation."""
    if random_init:
        return None
    if spec.path and any((Path(spec.path) / name).is_file() for name in WEIGHT_FILES):
        return spec.path
    if spec.source == "hub" and _hub_usable():
        return spec.reference  # from_pretrained downloads them
    return None


def load_tokenizer(spec: ModelSpec, explicit: str | None = None, trust_remote_code: bool = False):
    """The tokenizer of `explicit`, else of the model reference; ModelNotFound saying what to pass."""
    from transformers import AutoTokenizer

    local_only = not _hub_usable()  # offline, ask only the local cache rather than wait for timeouts
    candidates = [explicit] if explicit else list(dict.fromkeys(c for c in (spec.path, spec.reference) if c))
    reasons = []
    for candidate in candidates:
        local = Path(candidate).expanduser()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else candidate,
                                                      local_files_only=local_only, trust_remote_code=trust_remote_code)
        except Exception as exc:  # OSError, ValueError, TypeError...: all mean "no usable tokenizer there"
            reasons.append(f"{candidate}: {' '.join(str(exc).split())[:160]}")
            continue
        if _tokenizes(tokenizer):
            return tokenizer
        # transformers 5 builds an empty tokenizer (no vocabulary) from a directory holding only
        # config.json rather than failing; packing text with it would make blocks of unknown tokens.
        reasons.append(f"{candidate}: no tokenizer files (an empty vocabulary)")
    if explicit:
        raise ModelNotFound(f"--tokenizer {explicit}: cannot load a tokenizer from it ({'; '.join(reasons)}); "
                            f"give a directory holding tokenizer files, or a hub id.")
    where = f"{spec.path} has no tokenizer files" if spec.path else f"{spec.reference} is not in the Hugging Face cache"
    raise ModelNotFound(f"no tokenizer for {spec.reference}: {where}"
                        f"{' and the hub is unreachable' if local_only else ''}; pass --tokenizer PATH "
                        f"(a directory saved with tokenizer.save_pretrained, or a hub id).")


def _tokenizes(tokenizer) -> bool:
    """True when the tokenizer has a vocabulary: plain English becomes known tokens."""
    try:
        ids = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that cannot even encode English is as good as none
        return False
    unknown = getattr(tokenizer, "unk_token_id", None)
    return len(tokenizer) > 1 and bool(ids) and any(i != unknown for i in ids)


def build_model(spec: ModelSpec, attention: str, device: torch.device, weights: str | None, trust_remote_code: bool = False):
    """The causal LM to train, in fp32 (mixed precision keeps fp32 master weights, as the probes do)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attention, "dtype": torch.float32, "trust_remote_code": trust_remote_code}
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(weights, **kwargs)
    else:
        hf_config = spec.hf_config(trust_remote_code)
        with torch.device(device):  # built where it trains: no host copy of a large model
            model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    return model


# -- device and budget -------------------------------------------------------------------------
def _training_device(spec: str) -> torch.device:
    """The device to train on. Trainer trains on cuda:0 and wraps the model in DataParallel when it
    sees several GPUs, so a CUDA run is narrowed to the one chosen GPU (CUDA_VISIBLE_DEVICES, set
    before CUDA starts in this process) as its probes ran on one."""
    import torch

    from autotune.probe.devices import resolve_device

    text = (spec or "auto").strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()  # through NVML: does not start CUDA
    if text == "auto":
        if count == 0:
            return torch.device("cpu")
        text = "cuda"
    if not text.startswith("cuda"):
        return resolve_device(text)  # raises DeviceError with the right words
    if count == 0:
        raise DeviceError(f"--device {spec}: CUDA is not available here; use --device cpu.")
    try:
        index = int(text.split(":", 1)[1]) if ":" in text else 0
    except ValueError:
        raise DeviceError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N.") from None
    if index >= count:
        raise DeviceError(f"--device {spec}: only {count} CUDA device(s) here; use cuda:0..cuda:{count - 1}.")
    if count > 1:
        if torch.cuda.is_initialized():
            if index != 0:
                raise DeviceError(f"--device {spec}: CUDA already started in this process; select the GPU with "
                                  f"CUDA_VISIBLE_DEVICES={index} instead.")
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(count)]
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]
            index = 0
    return resolve_device(f"cuda:{index}")


def _enforce_budget(device: torch.device, budget: int, margin: int):
    """Cap memory as a probe does: CUDA allocator fraction, or the CPU accountant."""
    from autotune.margin import checked_margin_bytes
    from autotune.probe.budget import enforce_budget

    checked_margin_bytes(margin, budget)
    return enforce_budget(device, budget, margin)


# -- measuring the run -------------------------------------------------------------------------
def _meter_class():
    from transformers import TrainerCallback

    class RunMeter(TrainerCallback):
        """Times each optimizer step (synchronised on CUDA), follows the loss, reads the peaks."""

        def __init__(self, budget: EnforcedBudget, tokens_per_step: int, echo: Callable[[str], None] | None) -> None:
            self.budget, self.tokens_per_step, self.echo = budget, tokens_per_step, echo
            self.step_seconds: list[float] = []
            self.first_step: int | None = None
            self.last_loss: float | None = None
            self.eval_loss: float | None = None
            self.peak_allocated: int | None = None
            self.peak_reserved: int | None = None
            self._started = 0.0

        def _sync(self) -> None:
            if self.budget.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.budget.device)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first_step is None:
                self.first_step = state.global_step
            self._sync()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            self.step_seconds.append(time.perf_counter() - self._started)
            self.read_peaks()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                self.last_loss = float(logs["loss"])
            if "eval_loss" in logs:
                self.eval_loss = float(logs["eval_loss"])
            if self.echo is not None:
                shown = {k: v for k, v in logs.items() if k != "total_flos"}
                parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()]
                self.echo(f"step {state.global_step}/{state.max_steps}: {', '.join(parts)}")

        def read_peaks(self) -> None:
            self.peak_allocated, self.peak_reserved = self.budget.peaks()

        @property
        def steps(self) -> int:
            return len(self.step_seconds)

        @property
        def tokens_per_s(self) -> float | None:
            # The first step creates the optimizer state and loads kernels: leave it out when others ran.
            window = self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds
            return self.tokens_per_step * len(window) / sum(window) if window and sum(window) > 0 else None

    return RunMeter


def checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Trainer's checkpoint directories in `output_dir`, oldest step first."""
    path = Path(output_dir)
    if not path.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in path.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def _training_arguments(winner: _Winner, options: TrainOptions, output_dir: Path, device, has_eval: bool):
    """The hand-off's TrainingArguments for the winner, with this run's length, saving and logging."""
    from autotune.handoff import BestConfig

    config = winner.row.config
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
        "per_device_eval_batch_size": config.micro_batch,
        "prediction_loss_only": True,          # an evaluation keeps losses, not every logit
        "seed": options.seed,
    }
    if has_eval:
        overrides.update(eval_strategy="steps", eval_steps=options.save_steps)
    try:
        return BestConfig(winner.row, device.type).training_arguments(str(output_dir), **overrides)
    except (ValueError, ImportError) as exc:
        raise BadInput(f"transformers cannot train {config.label()} on {device}: {' '.join(str(exc).split())[:300]}") from None


# -- the run -----------------------------------------------------------------------------------
def default_output_dir(study: str) -> Path:
    return Path(DEFAULT_OUTPUT_ROOT) / re.sub(r"[^A-Za-z0-9._-]+", "_", study)


def train(
    options: TrainOptions,
    *,
    study: str | None = None,
    model: str | None = None,
    gpu_budget: int | None = None,
    db: str | None = None,
    echo: Callable[[str], None] = print,
    on_search_start: Callable | None = None,
    on_search_event: Callable | None = None,
) -> TrainOutcome:
    """Train with the winner of `study` (or, given `model` and `gpu_budget` without a finished
    study for them, search first) and record the run beside the probe that chose it.

    `gpu_budget` with a study overrides its budget for the proof. Raises AutotuneError for anything
    the user must fix, before the run is recorded; an OOM during the run is `status='oom'`.
    """
    from autotune.data import load_text, pack_blocks
    from autotune.models import resolve_model
    from autotune.search import default_study_name
    from autotune.store import open_store

    if study is None and model is None:
        raise BadInput("give --study NAME (a finished search), or --model and --gpu-budget to search first.")
    if model is not None and study is None and gpu_budget is None:
        raise BadInput("--model needs --gpu-budget (the memory to fit in), or give --study NAME of a finished search.")

    # 1. The configuration: a settled study, or a search to run once the data is known to be good.
    spec = resolve_model(model) if model is not None else None
    search_for: str | None = None
    winner: _Winner | None = None
    with open_store(db) as store:
        if spec is not None and gpu_budget is not None:
            name = study or default_study_name(spec, gpu_budget)
            winner = _settled_winner(store, name, spec, gpu_budget)
            if winner is None:
                search_for = name
        else:
            winner = _winner(store, study)
            spec = _study_model(winner, model)
            name = winner.study.name
    assert spec is not None

    output_dir = Path(options.output_dir).expanduser() if options.output_dir else default_output_dir(name)
    found = checkpoints(output_dir)
    if found and not options.resume:
        raise BadInput(f"{output_dir} holds checkpoints of an earlier run ({found[-1].name}); pass --resume to go on "
                       f"from it, or another --output-dir.")

    # 2. The data and the tokenizer, checked before anything is searched or recorded.
    text = load_text(options.dataset, column=options.text_column, eval_split=options.eval_split)
    echo(f"data: {text.describe()}")
    tokenizer = load_tokenizer(spec, options.tokenizer, options.trust_remote_code)
    vocab = spec.config.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise BadInput(f"the tokenizer has {len(tokenizer):,} tokens but {spec.reference}'s vocabulary has {vocab:,}: "
                       f"ids past {vocab - 1} have no embedding; pass the model's own tokenizer with --tokenizer.")

    # 3. Search if needed.
    if search_for is not None:
        winner = _search(spec, gpu_budget, search_for, options.device, db, echo, on_search_start, on_search_event)
    assert winner is not None
    config, row, record = winner.row.config, winner.row, winner.study
    echo(f"study {record.name}: {config.label()} (probe #{row.probe_id}: {row.tokens_per_s or 0:,.0f} tokens/s, "
         f"peak reserved {format_size(row.peak_reserved_bytes)} of {format_size(row.budget_bytes)})")
    warnings: list[str] = []
    if record.status != "finished":
        warnings.append(f"study {record.name} is {record.status}: training with the best configuration found so far")

    # 4. Blocks of the winner's size; the device and the budget; the Trainer's arguments.
    blocks = pack_blocks(text, tokenizer, config.block_size, seed=options.seed)
    echo(f"blocks: {blocks.describe()}")
    budget = gpu_budget if gpu_budget is not None else record.budget_bytes
    margin = record.margin_bytes if budget == record.budget_bytes else round(record.margin_bytes * budget / record.budget_bytes)
    device = _training_device(options.device or str(record.environment.get("device_type") or "auto"))
    if device.type != record.environment.get("device_type"):
        warnings.append(f"study {record.name} measured on {record.device_name}, this run trains on {device.type}: "
                        f"the probe's peak and speed do not compare")
    args = _training_arguments(winner, options, output_dir, device, blocks.eval is not None)
    weights = weights_location(spec, options.random_init)
    limits = _enforce_budget(device, budget, margin)
    resume_from = str(found[-1]) if options.resume and found else None
    if options.resume and not found:
        echo(f"resume: no checkpoint in {output_dir}; starting from the beginning")
    same_device = device.type == record.environment.get("device_type")
    echo(_describe_limits(limits, record.device_name if same_device else str(device)))
    for warning in warnings:
        echo(f"warning: {warning}")

    # 5. The run, recorded from here on.
    output_dir.mkdir(parents=True, exist_ok=True)
    context = _RunContext(spec=spec, winner=winner, options=options, output_dir=output_dir, blocks=blocks,
                          limits=limits, weights=weights, resume_from=resume_from, warnings=warnings, searched=search_for is not None)
    with open_store(db) as store:
        run_id = store.start_run(config=config, study_id=record.id, probe_id=row.probe_id, output_dir=str(output_dir.resolve()),
                                 dataset=options.dataset)
        echo(f"run #{run_id}: {config.label()} -> {output_dir}")
        return _run(context, run_id, store, args, tokenizer, echo)


def _search(spec: ModelSpec, budget: int | None, name: str, device: str | None, db: str | None,
            echo: Callable[[str], None], on_start: Callable | None, on_event: Callable | None) -> _Winner:
    """Run `autotune search` with its defaults for this device; the winner, or BudgetError."""
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, search

    assert budget is not None
    echo(f"no finished study {name!r} for {spec.reference} under {format_size(budget)}: searching first")
    outcome = search(spec.reference, budget, settings=ProbeSettings(device=device or "auto"), options=SearchOptions(study=name),
                     db=db, on_start=on_start, on_event=on_event)
    if outcome.stop_reason == "interrupted":
        raise KeyboardInterrupt
    if outcome.best is None:
        raise BudgetError(f"no configuration of {spec.reference} fits {format_size(budget)} (study {name}); "
                          f"give a larger --gpu-budget.")
    return _Winner(outcome.study, outcome.best)


def _describe_limits(limits: EnforcedBudget, device_name: str) -> str:
    if limits.device.type == "cuda":
        return (f"device: {device_name}; budget {format_size(limits.budget_bytes)}: allocator capped at "
                f"{format_size(limits.cap_bytes)} (CUDA context {format_size(limits.context_bytes)}, margin "
                f"{format_size(limits.margin_bytes)})")
    return (f"device: {device_name}; budget {format_size(limits.budget_bytes)}: memory accountant capped at "
            f"{format_size(limits.cap_bytes)} (margin {format_size(limits.margin_bytes)}); it counts every tensor, "
            f"so CPU steps run slower than without it")


@dataclass(slots=True)
class _RunContext:
    spec: ModelSpec
    winner: _Winner
    options: TrainOptions
    output_dir: Path
    blocks: Blocks
    limits: EnforcedBudget
    weights: str | None
    resume_from: str | None
    warnings: list[str]
    searched: bool


def _run(ctx: _RunContext, run_id: int, store: Store, args, tokenizer, echo: Callable[[str], None]) -> TrainOutcome:
    from transformers import PrinterCallback, Trainer, default_data_collator

    from autotune.probe.oom import classify_exception

    config, limits = ctx.winner.row.config, ctx.limits
    meter = _meter_class()(limits, config.tokens_per_step, echo if args.disable_tqdm else None)
    trainer = model = None
    started = time.perf_counter()
    metrics: dict[str, Any] = {}
    failure: str | None = None
    try:
        with limits.guard(), _quiet_bars(args.disable_tqdm):
            # Built inside the guard: on CPU the accountant must see the weights born.
            model = build_model(ctx.spec, config.attention, limits.device, ctx.weights, ctx.options.trust_remote_code)
            if limits.accountant is not None:
                # Weights read by from_pretrained come from safetensors without passing through
                # the dispatcher; a probe's from_config build is seen, and the two must compare.
                limits.accountant.adopt(model)
            how = f"weights from {ctx.weights}" if ctx.weights else "random initialisation from its config (no weights found)"
            echo(f"model: {ctx.spec.reference}: {how}")
            trainer = Trainer(model=model, args=args, train_dataset=ctx.blocks.train, eval_dataset=ctx.blocks.eval,
                              processing_class=tokenizer, data_collator=default_data_collator, callbacks=[meter])
            if args.disable_tqdm:
                trainer.remove_callback(PrinterCallback)  # the meter prints log lines through `echo`
            output = trainer.train(resume_from_checkpoint=ctx.resume_from)
            metrics.update(output.metrics)
            if ctx.blocks.eval is not None:
                metrics.update(trainer.evaluate())
            meter.read_peaks()
    except Exception as exc:
        meter.read_peaks()
        if classify_exception(exc) != "oom":
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-_ERROR_TAIL:]
            store.fail_run(run_id, text, summary=_summary(ctx, run_id, "error", meter, trainer, metrics, started, text))
            raise
        failure = " ".join(str(exc).split())[:_ERROR_TAIL]
        del exc  # its traceback holds the failing frames and their tensors
    except BaseException:  # Ctrl-C: the run did not finish; say so, keep the checkpoints
        store.fail_run(run_id, "interrupted", summary=_summary(ctx, run_id, "interrupted", meter, trainer, metrics, started, None))
        raise

    if failure is not None:
        step = trainer.state.global_step if trainer is not None else 0
        kept = checkpoints(ctx.output_dir)
        message = (f"out of memory at step {step}: {config.label()} needed more than the {format_size(limits.cap_bytes)} that "
                   f"the {format_size(limits.budget_bytes)} budget leaves (after context and margin); run #{run_id} "
                   f"is marked failed" + (f", checkpoints kept in {ctx.output_dir} ({kept[-1].name} is the latest)" if kept else ""))
        summary = _summary(ctx, run_id, "oom", meter, trainer, metrics, started, failure)
        summary["message"] = message
        store.fail_run(run_id, f"out of memory: {failure}", summary=summary)
        _write_summary(ctx.output_dir, summary)
        del trainer, model
        limits.release()
        return TrainOutcome("oom", run_id, ctx.winner.study.name, str(ctx.output_dir), summary, message,
                            list(ctx.warnings), ctx.searched)

    assert trainer is not None  # set before training, and training did not fail
    with _quiet_bars(args.disable_tqdm):
        trainer.save_model(str(ctx.output_dir))
        tokenizer.save_pretrained(str(ctx.output_dir))
    summary = _summary(ctx, run_id, "finished", meter, trainer, metrics, started, None)
    store.finish_run(run_id, steps=summary["steps"], tokens_per_s=summary["tokens_per_s"],
                     peak_allocated_bytes=summary["peak_allocated_bytes"], peak_reserved_bytes=summary["peak_reserved_bytes"],
                     final_loss=summary["final_loss"], summary=summary)
    _write_summary(ctx.output_dir, summary)
    del trainer, model
    limits.release()
    return TrainOutcome("finished", run_id, ctx.winner.study.name, str(ctx.output_dir), summary, None,
                        list(summary["warnings"]), ctx.searched)


@contextlib.contextmanager
def _quiet_bars(quiet: bool):
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


def _write_summary(output_dir: Path, summary: dict[str, Any]) -> None:
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _summary(ctx: _RunContext, run_id: int, status: str, meter, trainer, metrics: dict[str, Any], started: float,
             error: str | None) -> dict[str, Any]:
    """The run as autotune-run.json and the store's summary hold it."""
    from autotune.handoff import BestConfig

    row, record, limits = ctx.winner.row, ctx.winner.study, ctx.limits
    config = row.config
    state = trainer.state if trainer is not None else None
    steps = state.global_step if state is not None else 0
    first = meter.first_step if meter.first_step is not None else steps
    context = limits.context_now() if status == "finished" else limits.context_bytes
    required = meter.peak_reserved + context if meter.peak_reserved is not None else None
    runtime = metrics.get("train_runtime")
    warnings = list(ctx.warnings)
    ratio = None
    if meter.peak_reserved and row.peak_reserved_bytes:
        ratio = meter.peak_reserved / row.peak_reserved_bytes
        if ratio > 1 + PEAK_TOLERANCE:
            warnings.append(f"run peak reserved {format_size(meter.peak_reserved)} is {100 * (ratio - 1):.0f}% above the "
                            f"probe's {format_size(row.peak_reserved_bytes)}: the run holds something the probe did not "
                            f"(evaluation, checkpoint saving, real data); keep the margin in mind")
    if status == "finished" and required is not None and required + limits.margin_bytes > limits.budget_bytes:
        warnings.append(f"peak reserved + context {format_size(required)} + margin {format_size(limits.margin_bytes)} exceed "
                        f"the {format_size(limits.budget_bytes)} budget: the CUDA context grew during the run")
    eval_loss = _finite(meter.eval_loss if meter.eval_loss is not None else metrics.get("eval_loss"))
    final_loss = _finite(meter.last_loss if meter.last_loss is not None else metrics.get("train_loss"))
    return {
        "status": status,
        "run_id": run_id,
        "study": record.name,
        "probe_id": row.probe_id,
        "model": ctx.spec.reference,
        "weights": ctx.weights or "random-init",
        "dataset": ctx.options.dataset,
        "output_dir": str(ctx.output_dir.resolve()),
        "device": record.device_name if limits.device.type == record.environment.get("device_type") else str(limits.device),
        "device_type": limits.device.type,
        "config": {**config.to_dict(), "label": config.label()},
        "training_arguments": BestConfig(row, limits.device.type).trainer_kwargs(),
        "block_size": config.block_size,
        "tokens_per_step": config.tokens_per_step,
        "train_blocks": len(ctx.blocks.train),
        "eval_blocks": len(ctx.blocks.eval) if ctx.blocks.eval is not None else None,
        "resumed_from": ctx.resume_from,
        "steps": steps,
        "steps_this_run": max(0, steps - first) if state is not None else 0,
        "max_steps": state.max_steps if state is not None else ctx.options.max_steps,
        "tokens_per_s": _finite(meter.tokens_per_s),
        "wall_tokens_per_s": (meter.steps * config.tokens_per_step / runtime) if runtime else None,
        "train_seconds": runtime,
        "seconds": time.perf_counter() - started,
        "budget_bytes": limits.budget_bytes,
        "margin_bytes": limits.margin_bytes,
        "cap_bytes": limits.cap_bytes,
        "context_bytes": context,
        "peak_allocated_bytes": meter.peak_allocated,
        "peak_reserved_bytes": meter.peak_reserved,
        "required_bytes": required,
        "probe": {"peak_allocated_bytes": row.peak_allocated_bytes, "peak_reserved_bytes": row.peak_reserved_bytes,
                  "context_bytes": row.context_bytes, "tokens_per_s": row.tokens_per_s},
        "peak_vs_probe": ratio,
        "final_loss": final_loss,
        "eval_loss": eval_loss,
        "perplexity": math.exp(eval_loss) if eval_loss is not None and eval_loss < 50 else None,
        "warnings": warnings,
        "error": error,
    }


def render_summary(summary: dict[str, Any]) -> str:
    """The run's summary for a terminal."""
    lines = []
    tps = summary.get("tokens_per_s")
    speed = f", {tps:,.0f} tokens/s" if tps else ""
    seconds = summary.get("train_seconds")
    took = f" in {seconds:.1f} s" if seconds else ""
    lines.append(f"run #{summary['run_id']} {summary['status']}: {summary['steps']} steps "
                 f"({summary['steps_this_run']} this run){took}{speed}; {summary['config']['label']} on {summary['device']}")
    required = summary.get("required_bytes")
    budget, margin = summary["budget_bytes"], summary["margin_bytes"]
    reached = "" if summary["status"] == "finished" else " before it stopped"
    memory = (f"memory: peak allocated {format_size(summary['peak_allocated_bytes'])}, reserved "
              f"{format_size(summary['peak_reserved_bytes'])}{reached}")
    if summary.get("device_type") == "cuda":
        memory += f" + context {format_size(summary['context_bytes'])}"
    memory += f" of the {format_size(budget)} budget (margin {format_size(margin)})"
    if required is not None and summary["status"] == "finished":
        spare = budget - margin - required
        memory += f": fits, {format_size(spare)} to spare" if spare >= 0 else ": over the budget"
    lines.append(memory)
    probe = summary["probe"]
    ratio = summary.get("peak_vs_probe")
    probe_speed = f", {probe['tokens_per_s']:,.0f} tokens/s" if probe.get("tokens_per_s") else ""
    compared = f"; run/probe peak {ratio:.2f}" if ratio and summary["status"] == "finished" else ""
    lines.append(f"probe #{summary['probe_id']}: peak reserved {format_size(probe['peak_reserved_bytes'])}{probe_speed}{compared}")
    loss = summary.get("final_loss")
    if loss is not None:
        evaluation = ""
        if summary.get("eval_loss") is not None:
            perplexity = summary.get("perplexity")
            evaluation = f", eval loss {summary['eval_loss']:.4f}" + (f" (perplexity {perplexity:,.1f})" if perplexity else "")
        lines.append(f"loss: {loss:.4f}{evaluation}")
    if summary["status"] == "finished":
        lines.append(f"saved: {summary['output_dir']} (model, tokenizer, {SUMMARY_FILE})")
    for warning in summary.get("warnings") or []:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
