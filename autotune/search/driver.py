"""The driver: create or resume a study from a resolved request, predict memory, store the plan that
joining workers follow, then run the search loop (loop.py). Every settled candidate is stored as it
finishes, so the same command resumes an interrupted search."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput, StudyNotFound
from autotune.estimate import untraceable
from autotune.estimate.launch import EstimateError
from autotune.search.common import OnStart, Event, Progress, Runner, SearchOutcome
from autotune.search.knowledge import Knowledge
from autotune.search.loop import work
from autotune.search.study_plan import StudyPlan
from autotune.search.predictions import Prediction, Predicting, predict
from autotune.search.request import SearchRequest, preflight
from autotune.search.trials import Trials, distributions_of
from autotune.search.worker_state import WorkerState, worker_label
from autotune.vocabulary.status import RETRYABLE, ClaimState
from autotune.store import Store
from autotune.levers.evaluation import EVAL_RECIPE
from autotune.levers.recipes import DEFAULT_TRAINER
from autotune.levers.lengths import Lengths
from autotune.levers.tasks import stored_fixed_recipe

Predictor = Callable[[list[ProbeConfig], str], dict[str, Prediction]]


def run_search(
    request: SearchRequest,
    runner: Runner,
    store: Store,
    on_event: Callable[[Event], None] | None = None,
    on_start: OnStart | None = None,
    predictor: Predictor | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> SearchOutcome:
    """Search the request's space for the fastest configuration that fits its budget.

    Every resolved candidate is stored as it finishes (one transaction each), so an interrupted
    search resumes with the same study name and re-runs nothing it finished. This process is the
    study's first worker; others may join it (autotune.search.fleet.join_study) from any machine that
    reaches the database. A request not yet preflighted is preflighted here. (Whether the study
    finished earlier, so that the stored answer does, is the caller's to ask first, before any
    process starts: request.stored_answer.)
    """
    started = time.perf_counter()
    worker, trials = start_study(request, runner, store, on_start, predictor)
    try:
        return work(worker, runner, trials, on_event, starter=True, started=started, on_progress=on_progress)
    finally:
        trials.close()


def start_study(
    request: SearchRequest,
    runner: Runner,
    store: Store,
    on_start: OnStart | None = None,
    predictor: Predictor | None = None,
) -> tuple[WorkerState, Trials]:
    """Create or resume the study, predict memory, and store the plan that joining workers follow.
    Returns the first worker's state (run_search goes on to search with it)."""
    if request.environment is None:
        request = preflight(request, runner)
    assert request.environment is not None
    options = request.options
    _check_resumable(store, request)
    study = store.get_or_create_study(
        request.name,
        model=request.spec,
        environment=request.environment,
        budget_bytes=request.budget.total_bytes,
        margin_bytes=request.budget.margin_bytes,
        effective_batch=request.space.work_per_step,
        space=request.space.to_dict(),
    )
    store.claims.reopen(study.id, tuple(RETRYABLE))  # resume: timeouts and crashes get one more try
    # Claims left running by a search of this machine that is gone (killed, or stopped by a database
    # that failed before it could give them back) are probed again now, not after going stale.
    store.claims.release_dead(study.id)
    stored = StudyPlan.from_dict(study.plan).predictions if not options.fresh else {}
    margin = options.margin_for(request.environment.device_type, request.space.peft)
    knowledge = Knowledge.of(list(request.candidates), request.budget, margin, stored)
    worker = WorkerState(store, request, study, knowledge, worker_label(request.settings.device))
    worker.refresh()  # everything this study already settled
    if on_start is not None:
        on_start(study, request.environment, len(request.candidates), len(knowledge.outcomes), request.notes)
    _start_predicting(worker, runner, predictor)
    # Optuna's tables and study exist before the plan does: a worker may join as soon as it is
    # stored, and several processes creating Optuna's tables at once collide.
    trials = Trials(
        store.engine.url.render_as_string(hide_password=False),
        request.name,
        distributions_of(request.space),
        seed=0,
        about={
            "model": request.spec.reference,
            "budget_bytes": request.budget.total_bytes,
            "margin_bytes": request.budget.margin_bytes,
        },
    )
    worker.plan = StudyPlan(
        strategy=options.strategy,
        fresh=options.fresh,
        predict_margin=margin,
        patience=options.patience,
        heartbeat_seconds=options.heartbeat_seconds,
        confirm=options.confirm,
        probe=request.settings.to_plan(),
    )
    worker.take_predictions()
    store.set_study_plan(study.id, worker.plan.to_dict())
    worker.study = store.study(request.name)
    if not any(
        c.state == ClaimState.RUNNING and not c.stale
        for c in store.claims.of_study(study.id, stale_after=options.stale_after)
    ):
        trials.close_running()  # (only when no other worker is in the middle of a trial)
    return worker, trials


def _start_predicting(worker: WorkerState, runner: Runner, predictor: Predictor | None) -> None:
    """Start predicting the memory of the candidates still unsettled and without a prediction, in
    the background; wait for them here unless the search probes meanwhile."""
    request, knowledge = worker.request, worker.knowledge
    options = request.options
    if not options.predict or options.strategy == "grid-full" or not knowledge.unresolved():
        return
    # Kernels the model does not implement cannot be traced either: their probes are skipped.
    # (Answered from the runner's memory of the preflight check.)
    lacking = runner.check(request.spec, request.candidates[0], request.space.attentions)
    # (Nor can Liger's Triton kernels, or paged optimizer state. Those configs are probed unpredicted.)
    missing = [
        c
        for c in knowledge.unresolved()
        if c.key() not in knowledge.predictions and c.attention not in lacking and untraceable(c) is None
    ]
    if not missing:
        return
    compute = predictor or functools.partial(predict, trust_remote_code=request.settings.trust_remote_code)
    # The estimator's predictions arrive group by group (streaming); a predictor given by a caller
    # answers at once, unless it is launch.search's (the estimator, in background).
    worker.predicting = Predicting(
        functools.partial(compute, missing, worker.environment.device_type),
        missing,
        streaming=predictor is None or options.predict_in_background,
    )
    if not options.predict_in_background:
        # (Held to the command's deadline: past it, the search loop stops before its first probe.)
        if (
            worker.predicting.wait(request.deadline.remaining())
            and worker.predicting.error is not None
            and not isinstance(worker.predicting.error, EstimateError)
        ):
            raise worker.predicting.error


def _check_resumable(store: Store, request: SearchRequest) -> None:
    """A study's probes compare only on one environment and one task (what is trained): refuse,
    before writing anything, to mix."""
    assert request.environment is not None
    name, environment = request.name, request.environment
    try:
        study = store.study(name)
    except StudyNotFound:
        return
    if study.env_fingerprint != environment.fingerprint():
        differences = "; ".join(environment.differences(study.environment)) or "another environment"
        raise BadInput(
            f"study {name!r} was run on {study.device_name} ({differences}); its probes would not compare "
            f"with these: give a new --study name, or search where it ran (the same versions and OpenMP "
            f"settings)."
        )
    stored = stored_fixed_recipe(study.space)
    if request.space.fixed_recipe != stored:

        def listed(fields: dict) -> str:
            # The fields at the plain recipe's value (no evaluation, Trainer's step) go unsaid; the
            # data's lengths by what they are (a --dataset's).
            def said(name: str, value: object) -> str:
                if name == "lengths":
                    return f"batches of a --dataset's lengths ({Lengths.from_text(str(value)).describe(10**9)})"
                return f"{name} {value}"

            return ", ".join(
                said(k, v)
                for k, v in fields.items()
                if v is not None
                and (k not in EVAL_RECIPE or v != EVAL_RECIPE[k])
                and (k != "trainer" or v != DEFAULT_TRAINER)
            )

        if stored.get("lengths") is not None and request.space.fixed_recipe.get("lengths") is None:
            raise BadInput(
                f"study {name!r} timed batches of a --dataset's lengths: give the same --dataset (and "
                f"--packing) again to resume it, or a new --study name."
            )
        raise BadInput(
            f"study {name!r} measured {listed(stored)}, not {listed(request.space.fixed_recipe)}: its leaderboard "
            f"would mix what is trained; give a new --study name."
        )
