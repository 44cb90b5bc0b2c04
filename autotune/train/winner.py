"""Which configuration to train: the best of a study, of a finished study of the same model and
budget, or of a search run for the purpose."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.errors import BadInput, BudgetError, ModelNotFound, StudyNotFound
from autotune.status import StopReason, StudyStatus
from autotune.units import format_size

if TYPE_CHECKING:
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


def settled_winner(store: Store, name: str, spec: ModelSpec, budget: int) -> Winner | None:
    """The winner of a finished study of this model and budget, or None (the search must run)."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    if study.status != StudyStatus.FINISHED or study.model_fingerprint != spec.fingerprint or study.budget_bytes != budget:
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
                      echo: Callable[[str], None], on_start: Callable | None, on_event: Callable | None) -> Winner:
    """Run `autotune search` with its defaults for this device; the winner, or BudgetError."""
    # Looked up at call time, not import time: tests narrow the search by replacing autotune.search.search.
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, search

    echo(f"no finished study {name!r} for {spec.reference} under {format_size(budget)}: searching first")
    outcome = search(spec.reference, budget, settings=ProbeSettings(device=device or "auto"), options=SearchOptions(study=name),
                     db=db, on_start=on_start, on_event=on_event)
    if outcome.stop_reason == StopReason.INTERRUPTED:
        raise KeyboardInterrupt
    if outcome.best is None:
        raise BudgetError(f"no configuration of {spec.reference} fits {format_size(budget)} (study {name}); "
                          f"give a larger --gpu-budget.")
    return Winner(outcome.study, outcome.best)
