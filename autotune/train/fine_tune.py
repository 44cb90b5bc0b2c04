"""`train()`: from a study (or a model and a budget) to a recorded run. Everything a user can get
wrong is checked, in order, before the run is recorded; then `autotune.train.run` runs it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import BadInput
from autotune.recipes import is_qlora
from autotune.status import StudyStatus
from autotune.train.loading import check_vocabulary, load_tokenizer, weights_location
from autotune.train.options import TrainOptions, TrainOutcome
from autotune.train.run import (RunContext, checkpoints, default_output_dir, describe_limits, run_training,
                                training_arguments)
from autotune.train.winner import (Recipe, Winner, matching_study, planned_recipe, search_for_winner, settled_winner,
                                   study_model, study_winner)
from autotune.units import format_size


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
    db: str | None = None,
    echo: Callable[[str], None] = print,
    on_search_start: Callable | None = None,
    on_search_event: Callable | None = None,
) -> TrainOutcome:
    """Train with the winner of `study` (or, given `model` and `gpu_budget` without a finished
    study for them, search first) and record the run beside the probe that chose it.

    `gpu_budget` with a study overrides its budget for the proof. `task`, `target_length` and
    `num_labels` are the search's task fields (autotune.tasks), `peft` its LoRA adapters (the
    --peft flags' text, autotune.recipes.peft_text); with a study, they may only repeat what it
    measured. Raises AutotuneError for anything the user must fix, before the run is recorded; an
    OOM during the run is `status='oom'`.
    """
    from autotune.models import resolve_model
    from autotune.search import default_study_name
    from autotune.store import check_study_name, open_store, resolve_url
    from autotune.store.engine import sqlite_path
    from autotune.tasks import Task

    if study is None and model is None:
        raise BadInput("give --study NAME (a finished search), or --model and --gpu-budget to search first.")
    if model is not None and study is None and gpu_budget is None:
        raise BadInput("--model needs --gpu-budget (the memory to fit in), or give --study NAME of a finished search.")
    if study is not None and not study.strip():
        raise BadInput("--study is empty; give the name of a finished search (list them with `autotune studies`).")

    # 1. The configuration: a settled study, or a search to run once the data is known to be good.
    # Read only: a refused command must leave the database as it was (the search creates or upgrades it).
    spec = resolve_model(model) if model is not None else None
    search_for: str | None = None
    winner: Winner | None = None
    flags: dict[str, Any] = {"task": task, "target_length": target_length, "num_labels": num_labels, "peft": peft}
    if spec is not None and gpu_budget is not None:
        # The study may be created by the search below: its name is checked before anything runs.
        name = check_study_name(study) if study is not None else default_study_name(spec, gpu_budget)
        existing = None
        path = sqlite_path(resolve_url(db))
        if path is None or path.exists():  # no database yet: nothing settled, the search makes it
            with open_store(db, read_only=True) as store:
                existing = matching_study(store, name, spec, gpu_budget)
                winner = settled_winner(store, name, spec, gpu_budget)
        recipe, search_recipe = planned_recipe(spec, name, existing, flags)
        if winner is None:
            search_for = name
    else:
        with open_store(db, read_only=True) as store:
            winner = study_winner(store, study)
        spec = study_model(winner, model)
        name = winner.study.name
        recipe = Recipe.of_config(winner.row.config)
        recipe.check(name, **flags)
    assert spec is not None
    trains = Task(recipe.task)
    if options.merge and recipe.peft is None:
        raise BadInput(f"--merge merges LoRA adapters into the base, but study {name!r} fine-tunes the whole model "
                       f"(no --peft): leave --merge out, or train adapters with --peft lora (a study of their own).")
    if options.merge and is_qlora(recipe.peft):
        # Merged into 4-bit weights, the adapters' small update would be rounded away.
        raise BadInput(f"--merge: study {name!r} trains QLoRA adapters on a 4-bit base, and merging them into 4-bit weights "
                       f"would round their update away; leave --merge out and merge the saved adapters into the "
                       f"full-precision base (peft: PeftModel.from_pretrained(base, adapters).merge_and_unload()).")

    output_dir = Path(options.output_dir).expanduser() if options.output_dir else default_output_dir(name)
    check_output_dir(output_dir)
    found = checkpoints(output_dir)
    if found and not options.resume:
        raise BadInput(f"{output_dir} holds checkpoints of an earlier run ({found[-1].name}); pass --resume to go on "
                       f"from it, or another --output-dir.")

    # 2. The data and the tokenizer, checked before anything is searched or recorded. (torch comes with
    # autotune.probe's budget and devices: imported only now, so that the checks above answer at once.)
    from autotune.margin import checked_margin_bytes
    from autotune.probe.budget import enforce_budget
    from autotune.probe.devices import resolve_training_device
    from autotune.probe.speedups import use_allocator
    from autotune.probe.step import check_recipe
    from autotune.train.task_data import Examples, check_tokenizer, load_task_data, prepare_examples

    data = load_task_data(trains, options)
    echo(f"data: {data.describe()}")
    tokenizer = load_tokenizer(spec, options.tokenizer, options.trust_remote_code)
    check_vocabulary(spec, tokenizer)
    check_tokenizer(trains, tokenizer, options.tokenizer or spec.reference)

    # 3. Search if needed: a new study's classifier is measured with the data's labels.
    if search_for is not None:
        assert gpu_budget is not None  # a search is only planned for a model and a budget
        if trains == Task.CLASSIFICATION and data.labels is not None:
            search_recipe.setdefault("num_labels", data.labels.count)
        winner = search_for_winner(spec, gpu_budget, search_for, options.device, db, echo, on_search_start, on_search_event,
                                   **search_recipe)
    assert winner is not None
    config, row, record = winner.row.config, winner.row, winner.study
    if config.task != trains:  # a study's probes are all of its task; a mixed one cannot be trained from
        raise BadInput(f"study {record.name}'s best configuration trains {config.task}, not {trains}; search again "
                       f"under a new --study name.")
    echo(f"study {record.name}: {config.label()} (probe #{row.probe_id}: {row.tokens_per_s or 0:,.0f} tokens/s, "
         f"peak reserved {format_size(row.peak_reserved_bytes)} of {format_size(row.budget_bytes)})")
    warnings: list[str] = []
    if record.status != StudyStatus.FINISHED:
        warnings.append(f"study {record.name} is {record.status}: training with the best configuration found so far")

    # 4. Blocks (or examples) of the winner's size; the device and the budget; the Trainer's arguments.
    blocks = prepare_examples(data, tokenizer, config, seed=options.seed)
    echo(f"{'examples' if isinstance(blocks, Examples) else 'blocks'}: {blocks.describe()}")
    if data.labels is not None and config.num_labels is not None and data.labels.count != config.num_labels:
        warnings.append(f"the data has {data.labels.count} label{'s' if data.labels.count != 1 else ''} and the probe "
                        f"measured a head of {config.num_labels}: the run's head has {data.labels.count} (its memory "
                        f"differs by little)")
    budget = gpu_budget if gpu_budget is not None else record.budget_bytes
    # Another budget keeps the study's margin as the same share of it.
    margin = record.margin_bytes if budget == record.budget_bytes else round(record.margin_bytes * budget / record.budget_bytes)
    study_device_type = record.environment.get("device_type")
    allocator = use_allocator(config.allocator)  # before CUDA starts: the allocator reads it once
    if allocator:
        echo(f"allocator: {allocator}")
    device = resolve_training_device(options.device or str(study_device_type or "auto"))
    if device.type != study_device_type:
        warnings.append(f"study {record.name} measured on {record.device_name}, this run trains on {device.type}: "
                        f"the probe's peak and speed do not compare")
    check_recipe(config, device)  # peft installed; no QLoRA off CUDA
    if config.compile and device.type == "cpu":
        warnings.append("torch.compile does not run under the CPU memory accountant (a dispatch mode, which "
                        "TorchDynamo does not trace under): this CPU run trains the compiled winner eagerly")
    args = training_arguments(winner, options, output_dir, device, blocks.eval is not None)
    weights = weights_location(spec, options.random_init)
    checked_margin_bytes(margin, budget)
    limits = enforce_budget(device, budget, margin)
    resume_from = str(found[-1]) if options.resume and found else None
    if options.resume and not found:
        echo(f"resume: no checkpoint in {output_dir}; starting from the beginning")
    echo(describe_limits(limits, record.device_name if device.type == study_device_type else str(device)))
    for warning in warnings:
        echo(f"warning: {warning}")

    # 5. The run, recorded from here on.
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # what check_output_dir cannot see (as root, a read-only mount, a full disk)
        raise BadInput(f"--output-dir {output_dir}: cannot create it ({exc.strerror}); pass --output-dir with a "
                       f"writable place.") from None
    context = RunContext(spec=spec, winner=winner, options=options, output_dir=output_dir, blocks=blocks, limits=limits,
                         weights=weights, resume_from=resume_from, warnings=warnings, searched=search_for is not None,
                         labels=data.labels)
    with open_store(db) as store:
        run_id = store.start_run(config=config, study_id=record.id, probe_id=row.probe_id, output_dir=str(output_dir.resolve()),
                                 dataset=options.dataset)
        echo(f"run #{run_id}: {config.label()} -> {output_dir}")
        return run_training(context, run_id, store, args, tokenizer, echo)


def check_output_dir(output_dir: Path) -> None:
    """BadInput unless `output_dir` is a directory, or can be made one, that this user can write:
    checked before the run is recorded, so that a mistyped --output-dir costs nothing."""
    if output_dir.exists() and not output_dir.is_dir():
        raise BadInput(f"--output-dir {output_dir} is a file, not a directory; pass --output-dir with a directory "
                       f"(new or holding earlier runs).")
    # The nearest part of the path that exists must be a directory we may write into.
    existing = output_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(f"--output-dir {output_dir}: {existing} is a file, so no directory can be made there; pass "
                       f"--output-dir with another place.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"--output-dir {output_dir}: {existing} cannot be written by this user; pass --output-dir with "
                       f"a writable place.")
