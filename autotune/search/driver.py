"""The driver: create or resume a study, then settle candidates one by one (probe, reuse, or skip)
until none is left, a limit is reached, or Ctrl-C. Every settled candidate is stored as it
finishes, so the same command resumes an interrupted search."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from autotune import defaults
from autotune.config import ProbeConfig
from autotune.processes import Terminated
from autotune.environment import Environment
from autotune.errors import BadInput, BudgetError, StudyNotFound
from autotune.estimate import untraceable
from autotune.estimate.launch import EstimateError
from autotune.models import ModelSpec
from autotune.result import ProbeResult
from autotune.search.common import Event, Progress, Runner, SearchOptions, SearchOutcome
from autotune.search.knowledge import Knowledge
from autotune.search.plan import ProbePlan, StudyPlan
from autotune.search.confirm import Confirmation, confirm
from autotune.search.predictions import Prediction, Predicting, predict
from autotune.search.strategies import TpeStrategy, make_strategy
from autotune.search.trials import Trials, distributions_of
from autotune.search.worker_state import Heartbeat, WorkerState, worker_label
from autotune.space import SearchSpace
from autotune.tasks import stored_recipe
from autotune.status import RETRYABLE, ClaimState, ProbeStatus, SettleHow, StopReason, StudyStatus
from autotune.store import LeaderboardRow, Store, StudyRecord
from autotune.units import format_size


log = logging.getLogger("autotune")
# Fresh-process retries of a probe whose process died without a result.
CRASH_RETRIES = 2


@contextmanager
def stop_on_first_interrupt() -> Iterator[threading.Event]:
    """The first Ctrl-C asks the search to stop after the probe in flight; a second one aborts it.
    SIGTERM (what Slurm, Kubernetes and systemd send, often with a short grace period) aborts at
    once, as a second Ctrl-C does: the probe in flight is killed and its claim given back."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_interrupt(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    def on_terminate(signum, frame):
        stop.set()
        raise Terminated

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, on_interrupt),
                signal.SIGTERM: signal.signal(signal.SIGTERM, on_terminate)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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


def run_search(
    space: SearchSpace,
    spec: ModelSpec,
    budget_bytes: int,
    margin_bytes: int,
    runner: Runner,
    store: Store,
    options: SearchOptions | None = None,
    on_event: Callable[[Event], None] | None = None,
    on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None,
    predictor: Callable[[list[ProbeConfig], str], dict[str, Prediction]] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> SearchOutcome:
    """Search `space` for the fastest configuration of `spec` that fits `budget_bytes`.

    Every resolved candidate is stored as it finishes (one transaction each), so an interrupted
    search resumes with the same study name and re-runs nothing it finished. This process is the
    study's first worker; others may join it (autotune.search.fleet.join_study) from any machine that
    reaches the database.
    """
    options = options or SearchOptions()
    started = time.perf_counter()
    name = options.study if options.study is not None else default_study_name(spec, budget_bytes)

    # A finished study of the same space answers from the database: no worker, no torch.
    if not options.fresh and (answer := answer_from_store(store, name, space, started)) is not None:
        return answer
    worker, trials = start_study(space, spec, budget_bytes, margin_bytes, runner, store, options, on_start, predictor)
    try:
        return work(worker, runner, trials, on_event, starter=True, started=started, on_progress=on_progress)
    finally:
        trials.close()


def start_study(
    space: SearchSpace,
    spec: ModelSpec,
    budget_bytes: int,
    margin_bytes: int,
    runner: Runner,
    store: Store,
    options: SearchOptions,
    on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None,
    predictor: Callable[[list[ProbeConfig], str], dict[str, Prediction]] | None = None,
) -> tuple[WorkerState, Trials]:
    """Create or resume the study, predict memory, and store the plan that joining workers follow.
    Returns the first worker's state (run_search goes on to search with it)."""
    candidates = space.candidates()
    name = options.study if options.study is not None else default_study_name(spec, budget_bytes)
    environment = preflight(space, spec, budget_bytes, runner)
    _check_resumable(store, name, environment, space)
    study = store.get_or_create_study(name, model=spec, environment=environment, budget_bytes=budget_bytes,
                                      margin_bytes=margin_bytes, effective_batch=space.work_per_step, space=space.to_dict())
    store.reopen_claims(study.id, tuple(RETRYABLE))  # resume: timeouts and crashes get one more try
    knowledge = Knowledge(candidates, allowed_bytes=budget_bytes - margin_bytes,
                          skip_over_bytes=int(budget_bytes * (1 + options.predict_margin)))
    settings = getattr(runner, "settings", None)
    worker = WorkerState(store, study, space, spec, budget_bytes, margin_bytes, environment, options, knowledge,
                     worker_label(getattr(settings, "device", None)))
    worker.refresh()  # everything this study already settled
    if on_start is not None:
        on_start(study, environment, len(candidates), len(knowledge.outcomes))
    knowledge.predictions = StudyPlan.from_dict(study.plan).predictions if not options.fresh else {}
    if options.predict and options.strategy != "grid-full" and knowledge.unresolved():
        # Kernels the model does not implement cannot be traced either: their probes are skipped.
        # (Answered from the runner's memory of the preflight check.)
        lacking = runner.check(spec, candidates[0], space.attentions)
        # (Nor can Liger's Triton kernels, or paged optimizer state. Those configs are probed unpredicted.)
        missing = [c for c in knowledge.unresolved() if c.key() not in knowledge.predictions and c.attention not in lacking
                   and untraceable(c) is None]
        if missing:
            trusted = bool(getattr(settings, "trust_remote_code", False))
            compute = predictor or functools.partial(predict, trust_remote_code=trusted)
            # The estimator's predictions arrive group by group (streaming); a predictor given by a
            # caller answers at once, unless it is launch.search's (the estimator, in background).
            worker.predicting = Predicting(functools.partial(compute, missing, environment.device_type), missing,
                                           streaming=predictor is None or options.predict_in_background)
            if not options.predict_in_background:
                worker.predicting.wait()
                if worker.predicting.error is not None and not isinstance(worker.predicting.error, EstimateError):
                    raise worker.predicting.error
    # Optuna's tables and study exist before the plan does: a worker may join as soon as it is
    # stored, and several processes creating Optuna's tables at once collide.
    trials = Trials(store.engine.url.render_as_string(hide_password=False), name, distributions_of(space), seed=0,
                    about={"model": spec.reference, "budget_bytes": budget_bytes, "margin_bytes": margin_bytes})
    probe_plan = ProbePlan() if settings is None else ProbePlan(
        warmup_steps=settings.warmup_steps, measure_steps=settings.measure_steps, timeout=settings.timeout,
        trust_remote_code=settings.trust_remote_code, measure_seconds=settings.measure_seconds)
    worker.plan = StudyPlan(strategy=options.strategy, fresh=options.fresh, predict_margin=options.predict_margin,
                            patience=options.patience, heartbeat_seconds=options.heartbeat_seconds, probe=probe_plan)
    _take_predictions(worker)
    store.set_study_plan(study.id, worker.plan.to_dict())
    worker.study = store.study(name)
    if not any(c.state == ClaimState.RUNNING and not c.stale for c in store.claims(study.id, stale_after=options.stale_after)):
        trials.close_running()  # (only when no other worker is in the middle of a trial)
    return worker, trials


def _take_predictions(w: WorkerState) -> bool:
    """Let the search use the predictions that arrived since the last look, and keep them in the
    study's plan (for workers that join later). True when any were taken."""
    predicting = w.predicting
    if predicting is None:
        return False
    ready = predicting.ready  # (looked at first: whatever arrived before is taken below)
    arrived = predicting.take()
    if ready:
        w.predicting = None
        if predicting.error is not None:
            # Predictions only order and prune the probes: without them every config is probed.
            # (Some models cannot be traced on fake tensors: deberta reads values, `nonzero`.)
            w.warnings.append(f"memory predictions unavailable, every config is probed: {predicting.error}")
    if not arrived:
        return False
    w.knowledge.predictions = {**w.knowledge.predictions, **arrived}
    w.plan = dataclasses.replace(w.plan, predictions=dict(w.knowledge.predictions))
    return True


def work(w: WorkerState, runner: Runner, trials: Trials, on_event: Callable[[Event], None] | None, *,
          starter: bool, started: float, on_progress: Callable[[Progress], None] | None = None) -> SearchOutcome:
    """Take configurations of the study until none is left, the study is stopped, or a limit of
    this worker is reached. The starter sets the study's status when it stops; a joining worker
    marks it finished when the space is done and leaves it alone otherwise."""
    store, k, options = w.store, w.knowledge, w.options
    strategy = make_strategy(options, k, w.environment.device_type, trials)
    patience = options.patience if options.patience is not None else (defaults.TPE_PATIENCE if options.strategy == "tpe" else None)
    outcome = SearchOutcome(study=w.study, space=w.space, leaderboard=[], candidates=len(k.candidates))
    since_improvement = 0
    env_fp = w.environment.fingerprint()
    heartbeat = Heartbeat(store, w.study.id, w.label, options.heartbeat_seconds)
    try:
        with stop_on_first_interrupt() as stop:
            while True:
                if stop.is_set():
                    outcome.stop_reason = StopReason.INTERRUPTED
                    break
                status = w.refresh(on_event)
                if _take_predictions(w):
                    store.set_study_plan(w.study.id, w.plan.to_dict())
                    store.fill_predicted_peaks(w.study.id, {key: k.predictions[key].peak_bytes
                                                            for key in k.outcomes if key in k.predictions})
                if status != StudyStatus.RUNNING:
                    outcome.stop_reason = StopReason.FINISHED if status == StudyStatus.FINISHED else StopReason.STOPPED
                    break
                choice = strategy.next()
                if choice is None:
                    if not k.busy:
                        outcome.stop_reason = StopReason.EXHAUSTED
                        break
                    if options.timeout is not None and time.perf_counter() - started >= options.timeout:
                        outcome.stop_reason = StopReason.TIMEOUT
                        break
                    # Nothing to do until probes in flight on other workers report: wait for them.
                    stop.wait(min(1.0, options.heartbeat_seconds))
                    continue
                config, skip_reason = choice
                trial = getattr(strategy, "pending_trial", None)
                if isinstance(strategy, TpeStrategy):
                    strategy.pending_trial = None
                if skip_reason is None and trial is None and w.predicting is not None and w.predicting.expects(config):
                    # Predicting in the background: groups arrive in the order the search visits
                    # them, so this wait is short; then choose again with the group's predictions.
                    w.predicting.wait_for(config)
                    continue

                previous_best = k.best()
                prediction = k.predictions.get(config.key())
                settle: dict[str, Any] = {"worker": w.label, "env_fingerprint": env_fp,
                                          "trial_number": trial.number if trial is not None else None,
                                          "predicted_peak_bytes": prediction.peak_bytes if prediction else None}
                if skip_reason is not None:
                    result = ProbeResult(status=ProbeStatus.SKIPPED, budget_bytes=w.budget_bytes, margin_bytes=w.margin_bytes, error=skip_reason)
                    how = "skipped"
                    probe_id = store.settle(w.study.id, config, result, how=SettleHow.UNCLAIMED, cacheable=False, **settle)
                    outcome.skipped += probe_id is not None
                else:
                    cached = None if options.fresh else store.find_cached(config.key(), env_fp, w.spec.fingerprint, w.budget_bytes, w.margin_bytes)
                    if cached is not None:
                        result, how = cached, "reused"
                        probe_id = store.settle(w.study.id, config, result, how=SettleHow.UNCLAIMED, **settle)
                        outcome.reused += probe_id is not None
                    else:
                        limit = (StopReason.MAX_TRIALS if options.max_trials is not None and outcome.probed >= options.max_trials
                                 else StopReason.TIMEOUT if options.timeout is not None and time.perf_counter() - started >= options.timeout
                                 else None)
                        if limit is not None:
                            if trial is not None:
                                trials.tell(trial, None)
                            outcome.stop_reason = limit
                            break
                        if store.claim(w.study.id, config.key(), w.label, stale_after=options.stale_after) is None:
                            # Another worker took it between our look and our claim: pick again.
                            if trial is not None:
                                trials.tell(trial, None)
                            continue
                        with _showing_phases(runner, on_progress, config, len(k.outcomes), len(k.candidates)):
                            result = _probe(w, runner, heartbeat, config)
                        how = "probed"
                        outcome.probed += 1
                        outcome.probes_seconds += result.wall_seconds or 0.0
                        probe_id = store.settle(w.study.id, config, result, how=SettleHow.CLAIMED, **settle)
                if probe_id is None:
                    # Settled by another worker first (the same skip found at once, or a claim taken
                    # over from this worker while it looked dead): theirs is the stored outcome.
                    if trial is not None:
                        trials.tell(trial, None)
                    continue
                if trial is not None:
                    trials.tell(trial, result, config)
                else:
                    number = trials.add(config, result)
                    if number is not None:
                        store.set_trial_number(probe_id, number)
                # Timeouts, crashes and errors are learnt too, so this run does not ask again; a
                # resumed search ignores them (RETRYABLE) and tries once more.
                k.learn(config, result)
                best = k.best()
                improved = best is not None and (previous_best is None or best[0].key() != previous_best[0].key())
                if how == "probed":
                    since_improvement = 0 if improved else since_improvement + 1
                if on_event is not None:
                    on_event(Event(config, result, how, len(k.outcomes), len(k.candidates),
                                   best is not None and best[0].key() == config.key(), w.label))
                if patience is not None and since_improvement >= patience:
                    outcome.stop_reason = StopReason.PATIENCE
                    break
            # (A search that probed nothing, every result reused from earlier studies, adds no probes.)
            if starter and outcome.stop_reason == StopReason.EXHAUSTED and w.options.confirm and outcome.probed:
                _confirm(w, runner, on_event, stop.is_set, on_progress)  # the verdict is stored with the study
    except BaseException:
        # Aborted (a second Ctrl-C, SIGTERM, a user error from the runner): the study is not
        # left `running`, so that every later command sees it stopped and resumable.
        if starter:
            store.set_study_status(w.study.id, StudyStatus.INTERRUPTED)
        raise
    finally:
        heartbeat.close()

    outcome.unmeasured = w.unmeasured()
    outcome.failures = list(w.warnings)
    if starter:
        store.set_study_status(w.study.id, w.settled_status() if outcome.finished else StudyStatus.INTERRUPTED)
    elif outcome.finished and outcome.stop_reason != StopReason.FINISHED:
        store.set_study_status(w.study.id, w.settled_status())
    outcome.study = store.study(w.study.name)
    outcome.leaderboard = store.leaderboard(w.study.name)
    outcome.seconds = time.perf_counter() - started
    return outcome


def _confirm(w: WorkerState, runner: Runner, on_event: Callable[[Event], None] | None,
             stop: Callable[[], bool], on_progress: Callable[[Progress], None] | None) -> Confirmation | None:
    """Every candidate is settled: measure the contenders within noise of the best again."""
    total = len(w.knowledge.candidates)

    def said(row: LeaderboardRow, result: ProbeResult) -> None:
        if on_event is not None:
            on_event(Event(row.config, result, "confirming", total, total, False, w.label))

    def run(config: ProbeConfig, budget_bytes: int) -> ProbeResult:
        with _showing_phases(runner, on_progress, config, total, total, confirming=True):
            return runner.run(config, budget_bytes)

    return confirm(w.store, w.study, run, w.budget_bytes, on_probe=said, stop=stop)


@contextlib.contextmanager
def _showing_phases(runner: Runner, on_progress: Callable[[Progress], None] | None, config: ProbeConfig,
                    resolved: int, total: int, confirming: bool = False) -> Iterator[None]:
    """Tell `on_progress` that a probe of `config` starts, and each phase it reaches."""
    if on_progress is None:
        yield
        return
    started = time.monotonic()

    def said(phase: str) -> None:
        on_progress(Progress(config, phase, resolved, total, started, confirming))

    said("starting")
    has_phases = hasattr(runner, "on_phase")
    if has_phases:
        runner.on_phase = said  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if has_phases:
            runner.on_phase = None  # type: ignore[attr-defined]


def _probe(w: WorkerState, runner: Runner, heartbeat: Heartbeat, config: ProbeConfig) -> ProbeResult:
    """Run a claimed probe, heartbeating. A crash (the child killed, a segfault, a CUDA fault) is
    not a measurement: it is tried again in a fresh process, CRASH_RETRIES times. A probe that does
    not end (a second Ctrl-C, SIGTERM, a user error raised by the runner) gives its claim back, so
    that it is not left to go stale."""
    try:
        with heartbeat.holding(config.key()):
            result = runner.run(config, w.budget_bytes, w.spec)
            for attempt in range(2, CRASH_RETRIES + 2):
                if result.status != ProbeStatus.CRASHED:
                    break
                log.warning("%s crashed (%s); trying again in a fresh process (attempt %d)", config.label(), result.error, attempt)
                result = runner.run(config, w.budget_bytes, w.spec)
            else:
                if result.status == ProbeStatus.CRASHED:
                    result.error = f"crashed {CRASH_RETRIES + 1} times, each in a fresh process; last: {result.error}"
            return result
    except BaseException:
        w.store.release_claim(w.study.id, config.key(), w.label)
        raise


def preflight(space: SearchSpace, spec: ModelSpec, budget_bytes: int, runner: Runner) -> Environment:
    """Everything about a search that can be refused before its study's first write: the device,
    the budget against it, the model and every attention kernel built (on the meta device) by the
    probe's own code. A mistake then leaves the database as it was, and the fixed command starts
    cleanly. Returns the environment the probes run in."""
    environment = runner.environment()
    _check_budget(budget_bytes, environment)
    runner.check(spec, space.candidates()[0], space.attentions)
    return environment


def _check_budget(budget_bytes: int, environment: Environment) -> None:
    """A budget larger than the device cannot be emulated on it."""
    total = environment.device_total_bytes
    if total and budget_bytes > total:
        where = "this machine's memory" if environment.device_type == "cpu" else environment.device_name
        raise BudgetError(f"--gpu-budget {format_size(budget_bytes)} is larger than {where} ({format_size(total)}); "
                          f"give at most {format_size(total)}.")


def _check_resumable(store: Store, name: str, environment: Environment, space: SearchSpace) -> None:
    """A study's probes compare only on one environment and one task (what is trained): refuse,
    before writing anything, to mix."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return
    if study.env_fingerprint != environment.fingerprint():
        raise BadInput(f"study {name!r} was run on {study.device_name} (or with other library versions); "
                       f"give a new --study name to search on {environment.device_name}.")
    stored = stored_recipe(study.space)
    if space.recipe != stored:
        def said(fields: dict) -> str:
            return ", ".join(f"{k} {v}" for k, v in fields.items() if v is not None)
        raise BadInput(f"study {name!r} measured {said(stored)}, not {said(space.recipe)}: its leaderboard would mix what "
                       f"is trained; give a new --study name.")


def stored_answer(db: str | None, name: str, space: SearchSpace, started: float, **outcome: Any) -> SearchOutcome | None:
    """The outcome of a study finished earlier over the same space, read without creating or
    upgrading anything and before any probe process starts (no torch): None when there is none."""
    from autotune.errors import DatabaseError
    from autotune.store import open_store

    try:
        with open_store(db, read_only=True) as store:
            return answer_from_store(store, name, space, started, **outcome)
    except DatabaseError:  # no database yet, or one the search will upgrade: nothing stored to answer with
        return None


def answer_from_store(store: Store, name: str, space: SearchSpace, started: float, **outcome: Any) -> SearchOutcome | None:
    """The outcome of the study called `name` if it finished over the same space; else None."""
    finished = finished_study(store, name, space)
    if finished is None:
        return None
    return SearchOutcome(study=finished, space=space, leaderboard=store.leaderboard(name), candidates=len(space.candidates()),
                         seconds=time.perf_counter() - started, answered_from_database=True, **outcome)


def finished_study(store: Store, name: str, space: SearchSpace) -> StudyRecord | None:
    """The study called `name` if it is finished over the same space (the answer is stored)."""
    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.status == StudyStatus.FINISHED and study.space == space.to_dict() else None
