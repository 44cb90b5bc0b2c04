"""`train()`: from a study (or a model and a budget) to a recorded run. Everything a user can get
wrong is checked, in order, before the run is recorded; then `autotune.train.run` runs it.

`train()` is five steps, each a function below: `_plan_run` (the configuration: a settled study, or
a search to run), `_load_data` (the data and tokenizer), `_find_winner` (the search, if needed),
`_prepare_run` (examples, device, budget, Trainer's arguments) and `_record_run` (the run,
recorded). Nothing is recorded before the last, bar the study that a search in the third makes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.vocabulary.errors import BadInput
from autotune.levers.recipes import is_qlora
from autotune.levers.sharding import count_problems
from autotune.vocabulary.status import StudyStatus
from autotune.levers.tasks import PADDED_TASKS, Task
from autotune.data.tokenizer import check_vocabulary, load_tokenizer
from autotune.train.loading import check_weights, weights_location
from autotune.train.options import TrainOptions, TrainOutcome
from autotune.train.run import (
    RunContext,
    StoreRecorder,
    checkpoints,
    default_output_dir,
    describe_limits,
    run_training,
    training_arguments,
)
from autotune.train.winner import (
    FixedRecipe,
    Winner,
    asks_evaluation,
    matching_study,
    planned_fixed_recipe,
    search_for_winner,
    settled_winner,
    study_model,
    study_winner,
)
from autotune.vocabulary.units import format_size

# Below this free on --output-dir's disk a run is refused before it is recorded: its checkpoints and
# summary would not fit (a full disk found at the first save costs the steps before it).
MIN_FREE_BYTES = 64 << 20

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase, TrainingArguments

    from autotune.results.budget import Budget
    from autotune.data import Blocks
    from autotune.specs.models import ModelSpec
    from autotune.data.task_data import Examples, TaskData


def train(
    options: TrainOptions,
    *,
    study: str | None = None,
    model: str | None = None,
    gpu_budget: int | None = None,
    task: str | None = None,
    target_length: int | None = None,
    num_labels: int | None = None,
    peft: str | None = None,
    evaluation: dict[str, Any] | None = None,
    gpus: int | None = None,
    db: str | None = None,
    echo: Callable[[str], None] = print,
    on_search_start: Callable | None = None,
    on_search_event: Callable | None = None,
) -> TrainOutcome:
    """Train with the winner of `study` (or, given `model` and `gpu_budget` without a finished
    study for them, search first) and record the run beside the probe that chose it.

    `gpu_budget` with a study overrides its budget for the proof. `task`, `target_length` and
    `num_labels` are the search's task fields (autotune.levers.tasks), `peft` its LoRA adapters (the
    --peft flags' text, autotune.levers.recipes.peft_text); with a study, they may only repeat what it
    measured. `evaluation` is how the run evaluates (the evaluation flags, as
    autotune.flags.arguments.evaluation_asked gives them): the search measures it, a study's must be it,
    and a run with an --eval-split evaluates so, under the same cap. Raises AutotuneError for
    anything the user must fix, before the run is recorded; an OOM during the run is `status='oom'`.
    """
    flags: dict[str, Any] = {
        "task": task,
        "target_length": target_length,
        "num_labels": num_labels,
        "peft": peft,
        "evaluation": evaluation,
    }
    plan = _plan_run(options, study, model, gpu_budget, flags, db, gpus)
    check_weights(plan.spec, options.random_init)  # (before a search: a corrupt download costs nothing)
    data, tokenizer = _load_data(plan, options, echo)
    winner = _find_winner(plan, data, tokenizer, options, db, echo, on_search_start, on_search_event)
    if winner.row.config.ranks > 1:
        return _train_on_ranks(plan, winner, options, flags, db, echo)
    context, args = _prepare_run(plan, winner, data, tokenizer, options, echo)
    return _record_run(context, args, tokenizer, db, echo)


def _train_on_ranks(
    plan: RunPlan,
    winner: Winner,
    options: TrainOptions,
    flags: dict[str, Any],
    db: str | None,
    echo: Callable[[str], None],
) -> TrainOutcome:
    """A winner probed on several ranks trains on as many (autotune.train.ranks): each rank plans,
    prepares and runs as `run_rank` says, and this process keeps the run."""
    from autotune.train.ranks import check_trainable_on_ranks, train_on_ranks

    device_type = (options.device or str(winner.study.environment.get("device_type") or "auto")).split(":")[0]
    check_trainable_on_ranks(winner, device_type)
    _make_output_dir(plan.output_dir)
    return train_on_ranks(
        winner, options, plan.output_dir, plan.gpu_budget, flags, db, echo, plan.searches, model=plan.spec.recorded
    )


def run_rank(
    options: TrainOptions,
    study: str,
    model: str | None,
    gpu_budget: int | None,
    flags: dict[str, Any],
    db: str | None,
    recorder: Any,
    run_id: int,
    echo: Callable[[str], None],
) -> TrainOutcome:
    """One rank of a run on several GPUs (started by train_on_ranks): the same plan, data, winner and
    preparation as a run on one GPU, on this rank's device under the same cap, its end kept by `recorder`."""
    # The study is settled by now: its winner, on the model the starter found (`model`), under its budget.
    plan = replace(_plan_run(options, study, model, None, flags, db), gpu_budget=gpu_budget)
    data, tokenizer = _load_data(plan, options, echo)
    winner = _find_winner(plan, data, tokenizer, options, db, echo, None, None)
    context, args = _prepare_run(plan, winner, data, tokenizer, options, echo)
    return run_training(context, run_id, recorder, args, tokenizer, echo)


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What step 1 settles, handed down so that no later step works it out again."""

    spec: ModelSpec
    name: str  # the study's: settled, or the one the search will create
    task: Task  # what the study trains, so what the data must be
    winner: Winner | None  # None: the search finds it, once the data is known to be good
    search_fixed_recipe: dict[str, Any]  # the recipe fields to search with (empty for a settled study)
    gpu_budget: int | None  # as given; None keeps the study's
    output_dir: Path
    checkpoints: tuple[Path, ...]  # an earlier run's there, oldest first: --resume goes on from the last

    @property
    def searches(self) -> bool:
        """Whether the winner is still to be found (the run then says it searched first)."""
        return self.winner is None


@dataclass(frozen=True, slots=True)
class _Choice:
    """The configuration before its task and output directory are checked: one of two ways to it."""

    spec: ModelSpec
    name: str
    recipe: FixedRecipe
    winner: Winner | None
    search_fixed_recipe: dict[str, Any]


def _plan_run(
    options: TrainOptions,
    study: str | None,
    model: str | None,
    gpu_budget: int | None,
    flags: dict[str, Any],
    db: str | None,
    gpus: int | None = None,
) -> RunPlan:
    """What to train and where, checked before anything slow runs, so that a mistake costs nothing.
    `gpus`: the ranks asked for (--gpus): a study's winner must have been probed on as many, and a
    search runs on as many."""
    from autotune.specs.models import resolve_model

    _check_request(study, model, gpu_budget)
    if gpus is not None and (problems := count_problems(gpus)):
        raise BadInput("; ".join(problems) + ".")
    if asks_evaluation(flags.get("evaluation")) and options.eval_split is None:
        raise BadInput(
            "the evaluation flags (--eval-batch, --generate, ...) describe the run's evaluation, and it has "
            "no data to evaluate on: give --eval-split (a split name, a file, or a share such as 5%), or "
            "leave them out."
        )
    spec = resolve_model(model) if model is not None else None
    if spec is not None and gpu_budget is not None:
        choice = _choose_for_budget(spec, gpu_budget, study, flags, db, gpus or 1)
    else:
        choice = _choose_study(study, model, flags, db)
    if gpus is not None and choice.winner is not None and choice.winner.row.config.gpus != gpus:
        probed = choice.winner.row.config.gpus
        raise BadInput(
            f"--gpus {gpus} contradicts study {choice.name!r}, whose winner was probed on {probed} "
            f"GPU{'s' if probed != 1 else ''}; leave --gpus out to train it on {probed}, or search on {gpus} "
            f"under a new --study name."
        )
    trains = Task(choice.recipe.task)
    _check_merge(options, choice.recipe, choice.name)
    output_dir = Path(options.output_dir).expanduser() if options.output_dir else default_output_dir(choice.name)
    found = _checked_checkpoints(output_dir, options.resume)
    return RunPlan(
        spec=choice.spec,
        name=choice.name,
        task=trains,
        winner=choice.winner,
        search_fixed_recipe=choice.search_fixed_recipe,
        gpu_budget=gpu_budget,
        output_dir=output_dir,
        checkpoints=found,
    )


def _check_request(study: str | None, model: str | None, gpu_budget: int | None) -> None:
    """BadInput unless the flags name a configuration: a study, or a model and a budget to search."""
    if study is None and model is None:
        raise BadInput("give --study NAME (a finished search), or --model and --gpu-budget to search first.")
    if model is not None and study is None and gpu_budget is None:
        raise BadInput("--model needs --gpu-budget (the memory to fit in), or give --study NAME of a finished search.")
    if study is not None and not study.strip():
        raise BadInput("--study is empty; give the name of a finished search (list them with `autotune studies`).")


def _choose_for_budget(
    spec: ModelSpec, gpu_budget: int, study: str | None, flags: dict[str, Any], db: str | None, gpus: int = 1
) -> _Choice:
    """A finished study of this model and budget, else the search to run: read only, because a refused
    command must leave the database as it was (the search creates or upgrades it)."""
    from autotune.search import default_study_name
    from autotune.store import check_study_name, open_store, resolve_url
    from autotune.store.engine import sqlite_path

    # The study may be created by the search: its name is checked before anything runs.
    name = check_study_name(study) if study is not None else default_study_name(spec, gpu_budget, gpus)
    existing, winner = None, None
    path = sqlite_path(resolve_url(db))
    if path is None or path.exists():  # no database yet: nothing settled, the search makes it
        with open_store(db, read_only=True) as store:
            existing = matching_study(store, name, spec, gpu_budget)
            winner = settled_winner(store, name, spec, gpu_budget)
    recipe, search_fixed_recipe = planned_fixed_recipe(spec, name, existing, flags)
    if gpus > 1 and existing is None:
        search_fixed_recipe = {**search_fixed_recipe, "gpus": gpus}  # (the ranks: searched on as many)
    return _Choice(spec, name, recipe, winner, search_fixed_recipe)


def _choose_study(study: str | None, model: str | None, flags: dict[str, Any], db: str | None) -> _Choice:
    """The named (or latest) study's winner, read only for the same reason; the flags may only repeat it."""
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        winner = study_winner(store, study)
    spec = study_model(winner, model)
    name = winner.study.name
    recipe = FixedRecipe.of_config(winner.row.config)
    recipe.check(name, **flags)
    return _Choice(spec, name, recipe, winner, {})


def _check_merge(options: TrainOptions, recipe: FixedRecipe, name: str) -> None:
    """BadInput for a --merge that has no adapters to merge, or whose merge would be lost."""
    if options.merge and recipe.peft is None:
        raise BadInput(
            f"--merge merges LoRA adapters into the base, but study {name!r} fine-tunes the whole model "
            f"(no --peft): leave --merge out, or train adapters with --peft lora (a study of their own)."
        )
    if options.merge and is_qlora(recipe.peft):
        # Merged into 4-bit weights, the adapters' small update would be rounded away.
        raise BadInput(
            f"--merge: study {name!r} trains QLoRA adapters on a 4-bit base, and merging them into 4-bit weights "
            f"would round their update away; leave --merge out and merge the saved adapters into the "
            f"full-precision base (peft: PeftModel.from_pretrained(base, adapters).merge_and_unload())."
        )


def _checked_checkpoints(output_dir: Path, resume: bool) -> tuple[Path, ...]:
    """The checkpoints in `output_dir`, refused unless --resume (a new run must not overwrite an
    old one); --resume with none is refused too (it would quietly train from scratch)."""
    check_output_dir(output_dir)
    found = tuple(checkpoints(output_dir))
    if found and not resume:
        raise BadInput(
            f"{output_dir} holds checkpoints of an earlier run ({found[-1].name}); pass --resume to go on "
            f"from it, or another --output-dir."
        )
    if resume and not found:
        raise BadInput(
            f"--resume: {output_dir} holds no checkpoint to go on from; leave --resume out to train from the "
            f"beginning, or pass the --output-dir of the run to resume."
        )
    return found


def _load_data(
    plan: RunPlan, options: TrainOptions, echo: Callable[[str], None]
) -> tuple[TaskData, PreTrainedTokenizerBase]:
    """The data and the tokenizer, checked before anything is searched or recorded: a bad file costs no search."""
    from autotune.data.task_data import check_tokenizer, load_task_data

    data = load_task_data(plan.task, options.data)
    echo(f"data: {data.describe()}")
    tokenizer = load_tokenizer(plan.spec, options.tokenizer, options.trust_remote_code)
    check_vocabulary(plan.spec, tokenizer)
    check_tokenizer(plan.task, tokenizer, options.tokenizer or plan.spec.reference)
    return data, tokenizer


def _find_winner(
    plan: RunPlan,
    data: TaskData,
    tokenizer: PreTrainedTokenizerBase,
    options: TrainOptions,
    db: str | None,
    echo: Callable[[str], None],
    on_search_start: Callable | None,
    on_search_event: Callable | None,
) -> Winner:
    """The configuration to train, searched for only now that the data is known, and checked to train its task."""
    from autotune.data.task_data import example_lengths

    winner = plan.winner
    if winner is None:
        assert plan.gpu_budget is not None  # a search is only planned for a model and a budget
        search_fixed_recipe = dict(plan.search_fixed_recipe)
        # A new study's classifier is measured with the data's labels, and a padded task's probes
        # with the data's longest example (autotune.levers.tasks.DataShape): the longest batch the run forms.
        if plan.task == Task.CLASSIFICATION and data.labels is not None:
            search_fixed_recipe.setdefault("num_labels", data.labels.count)
        if plan.task in PADDED_TASKS:
            search_fixed_recipe["data_shape"] = example_lengths(data, tokenizer)
        winner = search_for_winner(
            plan.spec,
            plan.gpu_budget,
            plan.name,
            options.device,
            db,
            echo,
            on_search_start,
            on_search_event,
            **search_fixed_recipe,
        )
    config, row, record = winner.row.config, winner.row, winner.study
    if config.task != plan.task:  # a study's probes are all of its task; a mixed one cannot be trained from
        raise BadInput(
            f"study {record.name}'s best configuration trains {config.task}, not {plan.task}; search again "
            f"under a new --study name."
        )
    echo(
        f"study {record.name}: {config.label()} (probe #{row.probe_id}: {row.tokens_per_s or 0:,.0f} tokens/s, "
        f"peak reserved {format_size(row.peak_reserved_bytes)} of {format_size(row.budget_bytes)})"
    )
    return winner


def adopt_study_openmp(stored: Any) -> str:
    """The run's OpenMP settings made the study's probes' (Environment.openmp), so that the run times
    as its probe did: in the environment, which torch reads when it loads, and where torch was
    loaded already, its thread count. The settings, as one line ("" where the study recorded none)."""
    import sys

    from autotune.host.environment import adopt_openmp, openmp_of, openmp_text

    if stored is None:
        return ""
    adopt_openmp(stored)
    settings = openmp_of(stored)
    threads = dict(settings).get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    return openmp_text(settings)


def _prepare_run(
    plan: RunPlan,
    winner: Winner,
    data: TaskData,
    tokenizer: PreTrainedTokenizerBase,
    options: TrainOptions,
    echo: Callable[[str], None],
) -> tuple[RunContext, TrainingArguments]:
    """The examples, device, memory cap and Trainer's arguments, checked here before the run is recorded."""
    said_openmp = adopt_study_openmp(winner.study.environment.get("openmp"))
    if said_openmp:
        echo(f"OpenMP: {said_openmp} (as the study's probes ran)")
    # torch comes with autotune.probe: imported only now, so that the checks of step 1 answer at once.
    from autotune.results.budget import Budget
    from autotune.probe.cap import cap_memory
    from autotune.probe.devices import resolve_training_device
    from autotune.probe.speedups import use_allocator
    from autotune.probe.step import check_recipe
    from autotune.data.task_data import Examples, prepare_examples

    config, record = winner.row.config, winner.study
    blocks = prepare_examples(data, tokenizer, config, seed=options.seed)
    echo(f"{'examples' if isinstance(blocks, Examples) else 'blocks'}: {blocks.describe()}")
    # Another budget keeps the study's margin as the same share of it.
    budget = Budget(record.budget_bytes, record.margin_bytes).scaled_to(plan.gpu_budget or record.budget_bytes)
    study_device_type = record.environment.get("device_type")
    allocator = use_allocator(config.allocator)  # before CUDA starts: the allocator reads it once
    if allocator:
        echo(f"allocator: {allocator}")
    device = resolve_training_device(options.device or str(study_device_type or "auto"))
    check_recipe(config, device)  # peft installed; no QLoRA off CUDA
    args = training_arguments(winner, options, plan.output_dir, device, blocks.eval is not None)
    weights = weights_location(plan.spec, options.random_init)
    limits = cap_memory(device, budget)
    found = plan.checkpoints
    resume_from = str(found[-1]) if options.resume and found else None
    echo(describe_limits(limits, record.device_name if device.type == study_device_type else str(device)))
    warnings = _warnings(winner, data, device) + _evaluation_warnings(winner, blocks) + _other_budget(winner, budget)
    for warning in warnings:
        echo(f"warning: {warning}")
    context = RunContext(
        spec=plan.spec,
        winner=winner,
        options=options,
        output_dir=plan.output_dir,
        blocks=blocks,
        limits=limits,
        weights=weights,
        resume_from=resume_from,
        warnings=warnings,
        searched=plan.searches,
        labels=data.labels,
    )
    return context, args


def _warnings(winner: Winner, data: TaskData, device: torch.device) -> list[str]:
    """Where this run will not compare with the probe that chose it: said before it, and kept with it."""
    config, record = winner.row.config, winner.study
    warnings: list[str] = []
    if record.status != StudyStatus.FINISHED:
        warnings.append(f"study {record.name} is {record.status}: training with the best configuration found so far")
    if data.labels is not None and config.num_labels is not None and data.labels.count != config.num_labels:
        warnings.append(
            f"the data has {data.labels.count} label{'s' if data.labels.count != 1 else ''} and the probe "
            f"measured a head of {config.num_labels}: the run's head has {data.labels.count} (its memory "
            f"differs by little)"
        )
    if device.type != record.environment.get("device_type"):
        warnings.append(
            f"study {record.name} measured on {record.device_name}, this run trains on {device.type}: "
            f"the probe's peak and speed do not compare"
        )
    if config.compile and device.type == "cpu":
        warnings.append(
            "torch.compile does not run under the CPU memory accountant (a dispatch mode, which "
            "TorchDynamo does not trace under): this CPU run trains the compiled winner eagerly"
        )
    return warnings


def _evaluation_warnings(winner: Winner, blocks: Blocks | Examples) -> list[str]:
    """Where the run's evaluation is not what its probe measured: evaluation data for a winner whose
    probe ran none (the run evaluates as train always did, unmeasured), or a winner measured
    evaluating with no data to evaluate on (the run only trains)."""
    from autotune.levers.evaluation import evaluates, label

    config, record = winner.row.config, winner.study
    if blocks.eval is not None and not evaluates(config):
        return [
            f"study {record.name}'s probes ran no evaluation: this run evaluates at its micro-batch "
            f"({config.micro_batch}), loss only, in memory no probe measured; search with --eval-batch under a "
            f"new --study name to have it measured"
        ]
    if blocks.eval is None and evaluates(config):
        return [
            f"study {record.name} measured its run evaluating ({label(config).strip()}), but no --eval-split gives "
            f"this run data to evaluate on: it only trains"
        ]
    return []


def _other_budget(winner: Winner, budget: Budget) -> list[str]:
    """--gpu-budget with --study trains under another budget than the study measured (to see the
    winner on a smaller card, say): legal, but never silent, and plain when it cannot fit."""
    from autotune.results.budget import required_bytes

    row, record = winner.row, winner.study
    if budget.total_bytes == record.budget_bytes:
        return []
    need = required_bytes(row.peak_reserved_bytes, row.context_bytes)
    said = (
        f"training under --gpu-budget {format_size(budget.total_bytes)}, not the {format_size(record.budget_bytes)} "
        f"study {record.name} measured under"
    )
    if need is not None and not budget.fits(need):
        return [
            f"{said}: its winner needs {format_size(need)} with a {format_size(budget.margin_bytes)} margin, more than "
            f"that, and will run out of memory (search under {format_size(budget.total_bytes)} for a winner that fits)"
        ]
    return [f"{said}: the winner fits it, but was chosen as the fastest under the study's budget"]


def _record_run(
    context: RunContext,
    args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    db: str | None,
    echo: Callable[[str], None],
) -> TrainOutcome:
    """The run, recorded beside the probe that chose it before it starts, so that one that dies leaves its row."""
    from autotune.store import open_store

    output_dir, winner = context.output_dir, context.winner
    _make_output_dir(output_dir)
    with open_store(db) as store:
        for abandoned in store.runs.interrupt_abandoned(str(output_dir.resolve())):
            echo(f"run #{abandoned} into {output_dir} was still marked running, its process gone: marked interrupted")
        run_id = store.runs.start(
            config=winner.row.config,
            study_id=winner.study.id,
            probe_id=winner.row.probe_id,
            output_dir=str(output_dir.resolve()),
            dataset=context.options.dataset,
        )
        echo(f"run #{run_id}: {winner.row.config.label()} -> {output_dir}")
        return run_training(context, run_id, StoreRecorder(store, run_id, output_dir), args, tokenizer, echo)


def _make_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # what check_output_dir cannot see (as root, a read-only mount, a full disk)
        raise BadInput(
            f"--output-dir {output_dir}: cannot create it ({exc.strerror}); pass --output-dir with a writable place."
        ) from None


def check_output_dir(output_dir: Path) -> None:
    """BadInput unless `output_dir` is a directory, or can be made one, that this user can write:
    checked before the run is recorded, so that a mistyped --output-dir costs nothing."""
    if output_dir.exists() and not output_dir.is_dir():
        raise BadInput(
            f"--output-dir {output_dir} is a file, not a directory; pass --output-dir with a directory "
            f"(new or holding earlier runs)."
        )
    # The nearest part of the path that exists must be a directory we may write into.
    existing = output_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(
            f"--output-dir {output_dir}: {existing} is a file, so no directory can be made there; pass "
            f"--output-dir with another place."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(
            f"--output-dir {output_dir}: {existing} cannot be written by this user; pass --output-dir with "
            f"a writable place."
        )
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise BadInput(
            f"--output-dir {output_dir}: only {format_size(free)} free on its disk, less than the "
            f"{format_size(MIN_FREE_BYTES)} a run needs at least for its checkpoints; free some space, or pass "
            f"--output-dir on another disk."
        )
