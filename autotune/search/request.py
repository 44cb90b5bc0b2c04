"""A search, resolved once: from a user's flags to one frozen `SearchRequest` (the study's name, the
model, the space and its candidates, the budget with its margin, the options and probe settings),
checked before any process starts, then completed by one preflight with the device the probes
run on. The driver, the fleet and every worker take it whole instead of working any of it out
again (STYLE.md: resolve once, pass down)."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.budget import Budget
from autotune.config import ProbeConfig
from autotune.environment import Environment
from autotune.errors import BudgetError, DatabaseError, StudyNotFound
from autotune.models import ModelSpec
from autotune.probe.settings import ProbeSettings
from autotune.search.common import SearchOptions, SearchOutcome
from autotune.space import SearchSpace
from autotune.status import StudyStatus
from autotune.units import format_size

if TYPE_CHECKING:
    from autotune.search.common import Runner
    from autotune.store import Store, StudyRecord


def default_study_name(spec: ModelSpec, budget_bytes: int) -> str:
    """'gpt2-8GiB', 'gpt2-2.3GiB', 'tiny-24MiB': the model's last path part and the budget, so that
    the same command resumes the same study."""
    # A study name is kept to characters safe in paths and on command lines (check_study_name):
    # anything else in a directory's name becomes '_'.
    model = re.sub(r"[^A-Za-z0-9._:@+-]", "_", spec.reference.rstrip("/").split("/")[-1]).lstrip("-.") or "model"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if budget_bytes >= scale:
            return f"{model}-{budget_bytes / scale:.4g}{unit}"
    return f"{model}-{budget_bytes}B"


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """Everything a search is about, worked out once."""

    name: str                                 # the study's
    spec: ModelSpec
    space: SearchSpace
    budget: Budget
    options: SearchOptions
    settings: ProbeSettings
    candidates: tuple[ProbeConfig, ...]
    environment: Environment | None = None    # the device the probes run on, once preflight has asked

    @classmethod
    def of(cls, space: SearchSpace, spec: ModelSpec, budget: Budget, options: SearchOptions | None = None,
           settings: ProbeSettings | None = None) -> SearchRequest:
        """A request over `space`; BadInput when no candidate keeps the effective batch exact."""
        options = options or SearchOptions()
        name = options.study if options.study is not None else default_study_name(spec, budget.total_bytes)
        return cls(name, spec, space, budget, options, settings or ProbeSettings(), tuple(space.candidates()))

    def with_environment(self, environment: Environment) -> SearchRequest:
        return dataclasses.replace(self, environment=environment)

    @property
    def device_type(self) -> str:
        assert self.environment is not None, "preflight first"
        return self.environment.device_type


def resolve_search(model: str, budget_bytes: int, *, settings: ProbeSettings, options: SearchOptions,
                   **space_args: Any) -> SearchRequest:
    """`autotune search`'s flags as a request, checked without starting a process: the model
    resolved and usable, the space built against it, the margin within the budget."""
    from autotune.models import resolve_model

    spec = resolve_model(model)
    space = SearchSpace.build(spec, **space_args)
    spec.check_usable(settings.trust_remote_code)
    return SearchRequest.of(space, spec, settings.budget(budget_bytes), options, settings)


def preflight(request: SearchRequest, runner: Runner) -> SearchRequest:
    """Everything about a search that can be refused before its study's first write: the device,
    the budget against it, the model and every attention kernel built (on the meta device) by the
    probe's own code. A mistake then leaves the database as it was, and the fixed command starts
    cleanly. Returns the request with the environment the probes run in."""
    environment = runner.environment()
    _check_budget(request.budget, environment)
    runner.check(request.spec, request.candidates[0], request.space.attentions)
    return request.with_environment(environment)


def _check_budget(budget: Budget, environment: Environment) -> None:
    """A budget larger than the device cannot be emulated on it."""
    total = environment.device_total_bytes
    if total and budget.total_bytes > total:
        where = "this machine's memory" if environment.device_type == "cpu" else environment.device_name
        raise BudgetError(f"--gpu-budget {format_size(budget.total_bytes)} is larger than {where} ({format_size(total)}); "
                          f"give at most {format_size(total)}.")


def stored_answer(db: str | None, request: SearchRequest, started: float, **outcome: Any) -> SearchOutcome | None:
    """The outcome of the study finished earlier over the same space, read without creating or
    upgrading anything and before any probe process starts (no torch): None when there is none,
    or when the request asks for fresh probes."""
    from autotune.store import open_store

    if request.options.fresh:
        return None
    try:
        with open_store(db, read_only=True) as store:
            return answer_from_store(store, request, started, **outcome)
    except DatabaseError:  # no database yet, or one the search will upgrade: nothing stored to answer with
        return None


def answer_from_store(store: Store, request: SearchRequest, started: float, **outcome: Any) -> SearchOutcome | None:
    """The outcome of the request's study if it finished over the same space; else None."""
    finished = finished_study(store, request.name, request.space)
    if finished is None:
        return None
    return SearchOutcome(study=finished, space=request.space, leaderboard=store.leaderboard(request.name),
                         candidates=len(request.candidates), seconds=time.perf_counter() - started,
                         answered_from_database=True, **outcome)


def finished_study(store: Store, name: str, space: SearchSpace) -> StudyRecord | None:
    """The study called `name` if it is finished over the same space (the answer is stored)."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.status == StudyStatus.FINISHED and study.space == space.to_dict() else None
