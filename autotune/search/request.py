"""A search, resolved once: from a user's flags to one frozen `SearchRequest` (the study's name, the
model, the space and its candidates, the budget with its margin, the options and probe settings),
checked before any process starts, then completed by one preflight with the device the probes
run on. The driver, the fleet and every worker take it whole instead of working any of it out
again: resolved once, passed down."""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.deadline import Deadline, DeadlineReached
from autotune.host.environment import Environment
from autotune.vocabulary.errors import BadInput, BudgetError, DatabaseError, DeviceError, StudyNotFound
from autotune.specs.models import ModelSpec
from autotune.probe.settings import ProbeSettings
from autotune.search.common import SearchOptions, SearchOutcome
from autotune.levers.sharding import check_rendezvous
from autotune.search.space import SearchSpace
from autotune.vocabulary.status import StudyStatus
from autotune.levers.tasks import task_note
from autotune.vocabulary.units import format_duration, format_size

if TYPE_CHECKING:
    from autotune.search.common import Runner
    from autotune.store import Store, StudyRecord


def default_study_name(spec: ModelSpec, budget_bytes: int, gpus: int = 1) -> str:
    """'gpt2-8GiB', 'gpt2-2.3GiB', 'tiny-24MiB', 'gpt2-80GiB-x8': the model's last path part, the
    budget and the ranks beyond one, so that the same command resumes the same study."""
    # A study name is kept to characters safe in paths and on command lines (check_study_name):
    # anything else in a directory's name becomes '_'.
    model = re.sub(r"[^A-Za-z0-9._:@+-]", "_", spec.reference.rstrip("/").split("/")[-1]).lstrip("-.") or "model"
    ranks = f"-x{gpus}" if gpus > 1 else ""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if budget_bytes >= scale:
            return f"{model}-{budget_bytes / scale:.4g}{unit}{ranks}"
    return f"{model}-{budget_bytes}B{ranks}"


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """Everything a search is about, worked out once."""

    name: str  # the study's
    spec: ModelSpec
    space: SearchSpace
    budget: Budget
    options: SearchOptions
    settings: ProbeSettings
    candidates: tuple[ProbeConfig, ...]
    deadline: Deadline  # --timeout, by the wall clock, from the request's making
    environment: Environment | None = None  # the device the probes run on, once preflight has asked
    notes: tuple[str, ...] = ()  # what the search assumed, said with its header (the task)

    @classmethod
    def of(
        cls,
        space: SearchSpace,
        spec: ModelSpec,
        budget: Budget,
        options: SearchOptions | None = None,
        settings: ProbeSettings | None = None,
    ) -> SearchRequest:
        """A request over `space`, its deadline `options.timeout` from now; BadInput when no
        candidate keeps the effective batch exact."""
        options = options or SearchOptions()
        name = options.study if options.study is not None else default_study_name(spec, budget.total_bytes, space.gpus)
        return cls(
            name,
            spec,
            space,
            budget,
            options,
            settings or ProbeSettings(),
            tuple(space.candidates()),
            Deadline.after(options.timeout),
        )

    def with_environment(self, environment: Environment) -> SearchRequest:
        return dataclasses.replace(self, environment=environment)

    @property
    def device_type(self) -> str:
        assert self.environment is not None, "preflight first"
        return self.environment.device_type


def resolve_search(
    model: str, budget_bytes: int, *, settings: ProbeSettings, options: SearchOptions, **space_args: Any
) -> SearchRequest:
    """`autotune search`'s flags as a request, checked without starting a process: the model
    resolved and usable, the space built against it, the margin within the budget, and a device
    that can search it (no CUDA to be seen and no --device cpu: refused, with what the CPU would cost)."""
    from autotune.specs.models import resolve_model
    from autotune.probe.runner import cuda_may_be_visible

    from autotune.data.shape import shaped_space_args

    spec = resolve_model(model)
    spec.check_usable(settings.trust_remote_code, budget_bytes=budget_bytes)
    space = SearchSpace.build(spec, **shaped_space_args(spec, space_args, settings.trust_remote_code))
    check_rendezvous(space.nodes, settings.rendezvous)
    request = SearchRequest.of(space, spec, settings.budget(budget_bytes), options, settings)
    notes = [
        note for note in (shadowing_note(spec), task_note(spec.config, space_args.get("task")), *space.notes) if note
    ]
    if notes:
        request = dataclasses.replace(request, notes=tuple(notes))
    if settings.device_kind == "auto" and not cuda_may_be_visible():
        raise DeviceError(no_gpu_message(request))
    return request


def check_device_chosen(request: SearchRequest) -> None:
    """A search whose --device auto found no CUDA device (the probe child asked torch) is refused:
    the CPU is searched only when asked for (autotune search's flags; `resolve_search` refuses
    sooner where no NVIDIA device is to be seen at all)."""
    if request.settings.device_kind == "auto" and request.device_type == "cpu":
        raise DeviceError(no_gpu_message(request))


def shadowing_note(spec: ModelSpec) -> str | None:
    """A local directory read for a name that is also a known model's (./gpt2 for gpt2): said, with
    the config.json read, since the user may have meant the other."""
    from autotune.specs.models import KNOWN_ARCHITECTURES

    if spec.source == "local" and spec.reference.strip().rstrip("/") in KNOWN_ARCHITECTURES and spec.path:
        name = spec.reference.strip().rstrip("/")
        return (
            f"--model {spec.reference} read {spec.path}/config.json, a local directory of that name, not the "
            f"known {name}; for that one pass the hub's name with its owner (e.g. openai-community/{name})"
        )
    return None


def no_gpu_message(request: SearchRequest) -> str:
    """Why a search of --device auto is refused on a machine without CUDA, with what the CPU would
    take (predicted from the model's FLOPs and this CPU's measured speed) and the two ways on."""
    from autotune.specs.cpu_speed import cpu_cost, matmul_flops_per_s
    from autotune.specs.shapes import dims_from_config

    model = request.spec.reference
    cost = ""
    if (dims := dims_from_config(request.spec.config)) is not None:
        speed = matmul_flops_per_s()
        steps = request.settings.warmup_steps + request.settings.measure_steps
        probes = [cpu_cost(c, dims, speed).step_seconds * steps for c in request.candidates]
        cost = (
            f", about {format_duration(probes[0])} a probe ({steps} optimizer steps of "
            f"{request.candidates[0].padded_tokens_per_step:,.0f} tokens), up to {format_duration(sum(probes))} for its "
            f"{len(probes)} candidates (predicted from this CPU's measured speed)"
        )
    return (
        f"no CUDA device here: --device auto would search {model} on the CPU{cost}; pass --device cpu to search on "
        f"the CPU anyway, or run `autotune plan --model {model} --gpu NAME` to predict the search for a card "
        f"(`autotune plan --gpu list` names them)."
    )


def preflight(request: SearchRequest, runner: Runner) -> SearchRequest:
    """Everything about a search that can be refused before its study's first write: the device,
    the budget against it, the model and every attention kernel built (on the meta device) by the
    probe's own code. A mistake then leaves the database as it was, and the fixed command starts
    cleanly. Returns the request with the environment the probes run in."""
    try:
        environment = runner.environment(request.deadline)
        _check_budget(request.budget, environment)
        runner.check(request.spec, request.candidates[0], request.space.attentions, request.deadline)
    except DeadlineReached:
        # Nothing is written yet, so there is no study to go on with: a --timeout shorter than the
        # probe process's start-up is a mistake in the command, said as one.
        timeout = request.options.timeout or 0.0
        raise BadInput(
            f"--timeout {format_duration(timeout)} ran out while the probe process started and checked "
            f"the model, before any probe (nothing was written); give a longer --timeout."
        ) from None
    return request.with_environment(environment)


def _check_budget(budget: Budget, environment: Environment) -> None:
    """A budget larger than the device cannot be emulated on it."""
    total = environment.device_total_bytes
    if total and budget.total_bytes > total:
        where = "this machine's memory" if environment.device_type == "cpu" else environment.device_name
        raise BudgetError(
            f"--gpu-budget {format_size(budget.total_bytes)} is larger than {where} ({format_size(total)}); "
            f"give at most {format_size(total)}."
        )


def stored_answer(db: str | None, request: SearchRequest, started: float, **outcome: Any) -> SearchOutcome | None:
    """The outcome of the study finished earlier over the same space, read without creating or
    upgrading anything and before any probe process starts (no torch): None when there is none,
    or when the request asks for fresh probes."""
    from autotune.store import open_store, resolve_url

    resolve_url(db)  # a --db that is no database is refused here, before any process starts
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
    return SearchOutcome(
        study=finished,
        space=request.space,
        leaderboard=store.leaderboard(request.name),
        candidates=len(request.candidates),
        seconds=time.perf_counter() - started,
        answered_from_database=True,
        **outcome,
    )


def finished_study(store: Store, name: str, space: SearchSpace) -> StudyRecord | None:
    """The study called `name` if it is finished over the same space (the answer is stored)."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.status == StudyStatus.FINISHED and study.space == space.to_dict() else None
