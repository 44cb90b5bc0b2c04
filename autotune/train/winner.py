"""Which configuration to train: the best of a study, of a finished study of the same model and
budget, or of a search run for the purpose; and what it trains (its task), which flags given to
`train` may repeat but not contradict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from autotune.errors import BadInput, BudgetError, ModelNotFound, StudyNotFound
from autotune.status import StopReason, StudyStatus
from autotune.tasks import Task, resolve_task, stored_fixed_recipe
from autotune.units import format_size

if TYPE_CHECKING:
    from autotune.config import ProbeConfig
    from autotune.models import ModelSpec
    from autotune.store import LeaderboardRow, Store, StudyRecord


@dataclass(frozen=True, slots=True)
class Winner:
    """A study and its best configuration that fits."""

    study: StudyRecord
    row: LeaderboardRow


def study_winner(store: Store, name: str | None) -> Winner:
    """The best of study `name` (the latest study when None); StudyNotFound when nothing fits."""
    study = store.study(name)
    rows = store.leaderboard(study.name, top=1)
    if not rows:
        raise StudyNotFound(f"study {study.name!r} has no configuration that fits its {format_size(study.budget_bytes)} "
                            f"budget; search again with a larger --gpu-budget (or pass --model and --gpu-budget to train "
                            f"searches first).")
    return Winner(study, rows[0])


@dataclass(frozen=True, slots=True)
class FixedRecipe:
    """What a study trains (autotune.tasks): fixed for the study, so a flag may not contradict it."""

    task: str
    target_length: int | None = None
    num_labels: int | None = None
    peft: str | None = None

    @classmethod
    def of_config(cls, config: ProbeConfig) -> FixedRecipe:
        return cls(config.task, config.target_length, config.num_labels, config.peft)

    @classmethod
    def of_study(cls, study: StudyRecord) -> FixedRecipe:
        # A study stored before tasks existed (or a causal-LM one) has no task in its space.
        return cls(**stored_fixed_recipe(study.space or {}))

    def check(self, study: str, *, task: str | None = None, target_length: int | None = None,
              num_labels: int | None = None, peft: str | None = None) -> None:
        """BadInput for a flag that contradicts what study `study` measured. `peft` is the --peft
        flags' stored text (autotune.recipes.peft_text): the adapters are part of what is trained."""
        if task is not None and resolve_task({}, task, study) != self.task:
            raise BadInput(f"--task {task} contradicts study {study!r}, which measured {self.task}; leave --task out to "
                           f"train {self.task}, or search for {task.strip().lower()} under a new --study name.")
        for flag, given, measured, owner in (("--target-length", target_length, self.target_length, Task.SEQ2SEQ),
                                             ("--num-labels", num_labels, self.num_labels, Task.CLASSIFICATION)):
            if given is None or given == measured:
                continue
            if measured is None:
                raise BadInput(f"{flag} is for --task {owner}; study {study!r} trains {self.task}: leave it out.")
            raise BadInput(f"{flag} {given} contradicts study {study!r}, which measured {measured}; leave it out, or "
                           f"search again under a new --study name.")
        if peft is not None and peft != self.peft:
            trained = self.peft if self.peft is not None else "full fine-tuning (no --peft)"
            raise BadInput(f"--peft {peft} contradicts study {study!r}, which measured {trained}; leave --peft and "
                           f"the --lora-* flags out to train what it measured, or search again under a new --study name.")


def planned_fixed_recipe(spec: ModelSpec, name: str, existing: StudyRecord | None,
                   flags: dict[str, Any]) -> tuple[FixedRecipe, dict[str, Any]]:
    """What a run of `spec` under study `name` trains, and the recipe fields (the task's, and
    `peft`) to ask its search for. An `existing` study (finished, or to be resumed) decides: `flags`
    may repeat it, not contradict it, and a resumed search keeps its space. Else the flags given,
    checked, with the task's defaults."""
    if existing is not None:
        recipe = FixedRecipe.of_study(existing)
        recipe.check(name, **flags)
        return recipe, {field: value for field, value in asdict(recipe).items() if value is not None}
    task_flags = {field: value for field, value in flags.items() if field != "peft"}
    # The adapters are the user's choice alone (no default from the model): as given, or none.
    recipe = FixedRecipe(**spec.task_fields(**task_flags), peft=flags.get("peft"))
    return recipe, {field: value for field, value in flags.items() if value is not None}


def matching_study(store: Store, name: str, spec: ModelSpec, budget: int) -> StudyRecord | None:
    """Study `name` when it measured this model under this budget (finished or not), else None."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.model_fingerprint == spec.fingerprint and study.budget_bytes == budget else None


def settled_winner(store: Store, name: str, spec: ModelSpec, budget: int) -> Winner | None:
    """The winner of a finished study of this model and budget, or None (the search must run)."""
    study = matching_study(store, name, spec, budget)
    if study is None or study.status != StudyStatus.FINISHED:
        return None
    rows = store.leaderboard(name, top=1)
    return Winner(study, rows[0]) if rows else None


def study_model(winner: Winner, model: str | None) -> ModelSpec:
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


def search_for_winner(spec: ModelSpec, budget: int, name: str, device: str | None, db: str | None,
                      echo: Callable[[str], None], on_start: Callable | None, on_event: Callable | None,
                      **recipe: Any) -> Winner:
    """Run `autotune search` with its defaults for this device and the recipe fields in `recipe`
    (task, target_length, num_labels, peft); the winner, or BudgetError."""
    # Looked up at call time, not import time: tests narrow the search by replacing autotune.search.search.
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, search

    echo(f"no finished study {name!r} for {spec.reference} under {format_size(budget)}: searching first")
    outcome = search(spec.reference, budget, settings=ProbeSettings(device=device or "auto"), options=SearchOptions(study=name),
                     db=db, on_start=on_start, on_event=on_event, **recipe)
    if outcome.stop_reason == StopReason.INTERRUPTED:
        raise KeyboardInterrupt
    if outcome.best is None:
        raise BudgetError(f"no configuration of {spec.reference} fits {format_size(budget)} (study {name}); "
                          f"give a larger --gpu-budget.")
    return Winner(outcome.study, outcome.best)
